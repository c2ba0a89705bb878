-- replay: brings one reservation in Redis forward to the ledger's record of it
-- (after the fallback path changed it, or to rebuild a Redis that lost writes).
-- ARGV[2] user, ARGV[3] quantity, ARGV[4] the ledger's state, ARGV[5] its deadline
-- (ms), ARGV[6] the ledger's change number for it, ARGV[7] its sale.
--
-- Only forward: pending < active < confirmed < cancelled / expired. A marker that is
-- as far as the ledger or further is left alone (`in_line`), so an older ledger
-- never turns a confirmed reservation back to active, and replaying twice changes
-- nothing. Units move only when "holds units" changes.
-- ARGV[7] the sale the row belongs to: a row of another sale (the drop was
-- re-created since it was read) is not this sale's business.
if ARGV[7] ~= SALE then
  return reply('other_sale')
end
local rank = {pending = 0, active = 1, confirmed = 2, cancelled = 3, expired = 3}
local target = ARGV[4]
local m = {false, false, false}
if ours() then
  m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state')
end
if m[3] and (rank[m[3]] or 0) >= rank[target] then
  return answer('in_line')
end
local function holds(state)
  return state == 'active' or state == 'confirmed' or state == 'pending'
end
local user = m[1] or ARGV[2]
local quantity = tonumber(m[2] or ARGV[3])
-- A marker that is gone while its key is still in the due or pending set (an
-- evicted marker): Redis still counts its units, as for an active hold.
local before = m[3]
if not before and (redis.call('ZSCORE', K.holds, KEY) or redis.call('ZSCORE', K.pending, KEY)) then
  before = 'active'
end
if holds(before) and not holds(target) then
  give_back(user, quantity)
elseif not holds(before) and holds(target) then
  redis.call('DECRBY', K.remaining, quantity)
  redis.call('INCRBY', K.held, quantity)
  redis.call('HINCRBY', K.buyers, user, quantity)
end
if not m[3] then
  redis.call('DEL', K.marker)
end
redis.call('HSET', K.marker, 'user', user, 'quantity', quantity, 'state', target,
  'expiresAt', ARGV[5], 'sale', SALE, 'seq', ARGV[6])
if target == 'active' then
  redis.call('ZADD', K.holds, ARGV[5], KEY)
else
  redis.call('ZREM', K.holds, KEY)
end
redis.call('ZREM', K.pending, KEY)
local expire_at = redis.call('HGET', K.config, 'expireAt')
if expire_at and expire_at ~= '' then
  redis.call('PEXPIREAT', K.marker, expire_at)
else
  redis.call('PEXPIREAT', K.marker, tonumber(ARGV[5]) + 7 * 86400 * 1000)
end
return answer('replayed')
