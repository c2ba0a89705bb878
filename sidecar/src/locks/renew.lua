-- renew: KEYS[1] the lock, KEYS[2] its last fence. Extends the lease only for the
-- holder of ARGV[1]; ARGV[2] the new lease (ms). The fence key is kept a day past the
-- new lease too, as acquire keeps it: a lock renewed for days keeps its counter.
-- Returns {1, expiresAt ms} or {0, 0} when the lease was lost.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {0, 0}
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]) + 86400000)
local t = redis.call('TIME')
return {1, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])}
