-- lookup: the reservation as it stands, expiring it first if its deadline passed.
if EPOCH == '' then
  return reply('closed')
end
if not granted() then
  return reply('not_found')
end
expire_if_due(now_ms())
return answer('found')
