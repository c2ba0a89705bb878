-- acquire: KEYS[1] the lock, KEYS[2] its last fence.
-- ARGV[1] token, ARGV[2] lease (ms), ARGV[3] the ledger's highest fence for this lock.
--
-- SET NX PX and the next fence in one step: a holder always has a fence, and a later
-- holder a higher one. The fence is above the last one, above the ledger's highest,
-- and never below Redis's clock in microseconds: a Redis that lost the counter (a
-- restart without its data, a failover to a replica that missed the last acquires)
-- still hands out fences above every earlier one, whichever pod asks and whatever
-- its ledger knows, as long as the new Redis's clock is not behind the old one's by
-- more than the outage lasted. Returns {1, fence, expiresAt ms} or {0, 0, ms until
-- it frees}.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {0, 0, redis.call('PTTL', KEYS[1])}
end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local fence = math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + 1,
  tonumber(ARGV[3]) + 1, now_us)
-- Formatted by hand: Lua would write a number this large in exponent notation.
-- The fence key outlives the lease by a day and then goes, so that lock names used
-- once do not fill a Redis that evicts nothing: a fence handed out after it went is
-- still above every earlier one (the ledger's highest, and Redis's clock).
redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', tonumber(ARGV[2]) + 86400000)
return {1, fence, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])}
