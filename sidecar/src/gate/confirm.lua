-- confirm: an active, unexpired hold becomes confirmed and leaves the expiry queue.
if EPOCH == '' then
  return reply('closed')
end
if not granted() then
  return reply('not_found')
end
if expire_if_due(now_ms()) then
  return answer('expired')
end
local state = redis.call('HGET', K.marker, 'state')
if state == 'active' then
  redis.call('HSET', K.marker, 'state', 'confirmed')
  redis.call('ZREM', K.holds, KEY)
  bump()
  return answer('confirmed')
elseif state == 'confirmed' then
  return answer('already_confirmed')
end
return answer(state)
