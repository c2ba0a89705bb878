-- lookup: the reservation as it stands, expiring it first if its deadline passed.
-- One whose confirm or cancel is prepared is answered 'settling': whether that
-- change happened is the ledger's to say.
if EPOCH == '' then
  return reply('closed')
end
if foreign() then
  return refuse_foreign()
end
if ours() and redis.call('HGET', K.marker, 'state') == 'pending' then
  -- An admission not yet answered: whether it stands is decided within its bound.
  return answer('pending')
end
if not granted() then
  return reply('not_found')
end
if settling() then
  return answer('settling')
end
expire_if_due(now_ms())
return answer('found')
