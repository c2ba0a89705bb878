-- name: KEYS[1] the namespace's lock names in use (see LockKeys::names).
-- ARGV[1] the lock's name, ARGV[2] its lease (ms), ARGV[3] the most names the
-- namespace may have in use.
--
-- Notes the name as in use until a day past this lease (as its fence key lives),
-- after dropping names whose time ran out; a new name past the cap is refused (0).
-- A name already in use is always let through (its holder renewing, a contender
-- waiting), and its time only moves forward. Returns 1 or 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lapse = now + tonumber(ARGV[2]) + 86400000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and
    redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('ZADD', KEYS[1], 'GT', lapse, ARGV[1])
-- The set itself goes once its last name lapsed.
if redis.call('PTTL', KEYS[1]) < lapse - now then
  redis.call('PEXPIRE', KEYS[1], lapse - now)
end
return 1
