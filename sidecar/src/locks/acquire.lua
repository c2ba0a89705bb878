-- acquire: KEYS[1] the lock, KEYS[2] its fence counter, KEYS[3] the ledgers that
-- record its fences.
-- ARGV[1] token, ARGV[2] lease (ms), ARGV[3] the ledger's highest fence for this
-- lock, ARGV[4] the ledger's id.
--
-- SET NX PX and the fence's INCR in one step: a holder always has a fence, and a
-- later holder a higher one. The floor keeps fences growing after a failover that
-- lost the counter. Returns {1, fence, expiresAt ms, ledgers recording fences} or
-- {0, 0, ms until it frees, 0}.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {0, 0, redis.call('PTTL', KEYS[1]), 0}
end
local fence = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if fence <= floor then
  fence = floor + 1
  redis.call('SET', KEYS[2], fence)
end
redis.call('SADD', KEYS[3], ARGV[4])
local t = redis.call('TIME')
return {1, fence, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2]),
  redis.call('SCARD', KEYS[3])}
