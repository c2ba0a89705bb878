-- confirm: ARGV[3] attempt id, ARGV[4] the settle bound (ms): the ledger's commit
-- deadline, ARGV[5] the units to confirm ('' for all that are held; fewer give the
-- rest back when the confirm finishes: a partial confirm).
--
-- Prepares the confirm of an active, unexpired hold ('confirming'): nothing changes
-- for the buyer until the ledger recorded it and finish.lua makes it take effect;
-- if the ledger does not record it, abort.lua undoes the preparation and the
-- reservation is as it was. A confirm or cancel already in flight for the key is
-- answered 'settling' (ask again).
local early = before_existing()
if early then
  return early
end
local now = now_ms()
if expire_if_due(now) then
  return answer('expired')
end
local state = redis.call('HGET', K.marker, 'state')
if state == 'active' then
  local held = tonumber(redis.call('HGET', K.marker, 'quantity'))
  local kept = tonumber(ARGV[5]) or held
  if kept > held then
    -- More than is held: refused before anything is prepared.
    return answer('above_held')
  end
  prepare('confirmed', ARGV[3], now + tonumber(ARGV[4]))
  -- Never a leftover of an earlier preparation (one an older sidecar cleared
  -- without knowing the field): only this confirm's own.
  redis.call('HDEL', K.marker, 'settleQuantity')
  if kept < held then
    redis.call('HSET', K.marker, 'settleQuantity', kept)
  end
  return answer('confirming')
elseif state == 'confirmed' then
  return answer('already_confirmed')
end
return answer(state)
