-- expire (the sweeper): expires the hold if it is due; anything else is left alone.
if EPOCH == '' then
  return reply('closed')
end
if expire_if_due(now_ms()) then
  return answer('expired')
end
-- An entry of the due set whose hold is no longer held here (its marker gone,
-- another sale's, or confirmed / cancelled / expired) would stay at the head of
-- the set for ever and stop the sweep of every hold behind it: it is dropped.
-- Nothing is counted back: what the marker held is the ledger repair's business.
local state = ours() and redis.call('HGET', K.marker, 'state')
if state ~= 'active' and state ~= 'pending' then
  redis.call('ZREM', K.holds, KEY)
  return answer('stale_entry')
end
return answer('not_due')
