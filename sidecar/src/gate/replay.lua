-- replay: brings Redis in line with the ledger for one reservation that changed on
-- the fallback path. ARGV[2] user, ARGV[3] quantity, ARGV[4] the ledger's state,
-- ARGV[5] its deadline (ms). Idempotent: a reservation already in that state is left
-- alone; otherwise units move only when "holds units" changes.
local target = ARGV[4]
local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state')
if m[3] == target then
  return answer('in_line')
end
local function holds(state)
  return state == 'active' or state == 'confirmed' or state == 'pending'
end
local user = m[1] or ARGV[2]
local quantity = tonumber(m[2] or ARGV[3])
if holds(m[3]) and not holds(target) then
  give_back(user, quantity)
elseif not holds(m[3]) and holds(target) then
  redis.call('DECRBY', K.remaining, quantity)
  redis.call('INCRBY', K.held, quantity)
  redis.call('HINCRBY', K.buyers, user, quantity)
end
redis.call('HSET', K.marker, 'user', user, 'quantity', quantity, 'state', target,
  'expiresAt', ARGV[5])
if target == 'active' then
  redis.call('ZADD', K.holds, ARGV[5], KEY)
else
  redis.call('ZREM', K.holds, KEY)
end
local expire_at = redis.call('HGET', K.config, 'expireAt')
if expire_at and expire_at ~= '' then
  redis.call('PEXPIREAT', K.marker, expire_at)
else
  redis.call('PEXPIREAT', K.marker, tonumber(ARGV[5]) + 7 * 86400 * 1000)
end
return answer('replayed')
