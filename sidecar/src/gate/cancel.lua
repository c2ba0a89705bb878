-- cancel: ARGV[3] attempt id, ARGV[4] the settle bound (ms): the ledger's commit
-- deadline, ARGV[5] 'hold_only' to give back an active hold only (a confirmed one
-- answers 'already_confirmed' and stays so: a cart's give-back never refunds).
--
-- Prepares the cancel of an active reservation, or of a confirmed one (a refund)
-- unless 'hold_only' ('cancelling'): its units go back only once the ledger recorded the cancel and
-- finish.lua makes it take effect, so a cancel the ledger could not record changed
-- nothing (abort.lua). A duplicate cancel restores nothing: it is told 'settling'
-- while the first is in flight, then 'already_cancelled'.
local early = before_existing()
if early then
  return early
end
local now = now_ms()
if expire_if_due(now) then
  return answer('expired')
end
local state = redis.call('HGET', K.marker, 'state')
if state == 'confirmed' and ARGV[5] == 'hold_only' then
  return answer('already_confirmed')
elseif state == 'active' or state == 'confirmed' then
  prepare('cancelled', ARGV[3], now + tonumber(ARGV[4]))
  return answer('cancelling')
elseif state == 'cancelled' then
  return answer('already_cancelled')
end
return answer(state)
