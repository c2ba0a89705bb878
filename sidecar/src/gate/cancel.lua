-- cancel: an active or confirmed reservation (a refund) returns its units, once:
-- the state flips to cancelled in the same step, so a duplicate restores nothing.
if EPOCH == '' then
  return reply('closed')
end
if not granted() then
  return reply('not_found')
end
if expire_if_due(now_ms()) then
  return answer('expired')
end
local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state')
if m[3] == 'active' or m[3] == 'confirmed' then
  redis.call('HSET', K.marker, 'state', 'cancelled')
  redis.call('ZREM', K.holds, KEY)
  give_back(m[1], tonumber(m[2]))
  bump()
  return answer('cancelled')
elseif m[3] == 'cancelled' then
  return answer('already_cancelled')
end
return answer(m[3])
