-- lookup: the reservation as it stands, expiring it first if its deadline passed.
-- One whose confirm or cancel is prepared is answered 'settling': whether that
-- change happened is the ledger's to say.
local early = before_existing()
if early then
  return early
end
expire_if_due(now_ms())
return answer('found')
