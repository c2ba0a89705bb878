-- lookup: the reservation as it stands, expiring it first if its deadline passed.
if redis.call('EXISTS', K.marker) == 0 or not granted() then
  return {'not_found', '', '', '', '', ''}
end
expire_if_due(now_ms())
return answer('found')
