-- renew: extends the lease only for the holder of ARGV[1]; ARGV[2] the new lease (ms).
-- Returns {1, expiresAt ms} or {0, 0} when the lease was lost.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {0, 0}
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local t = redis.call('TIME')
return {1, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])}
