-- confirm: an active, unexpired hold becomes confirmed and leaves the expiry queue.
if redis.call('EXISTS', K.marker) == 0 or not granted() then
  return {'not_found', '', '', '', '', ''}
end
if expire_if_due(now_ms()) then
  return answer('expired')
end
local state = redis.call('HGET', K.marker, 'state')
if state == 'active' then
  redis.call('HSET', K.marker, 'state', 'confirmed')
  redis.call('ZREM', K.holds, KEY)
  return answer('confirmed')
elseif state == 'confirmed' then
  return answer('already_confirmed')
end
return answer(state)
