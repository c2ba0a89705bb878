-- expire (the sweeper): expires the hold if it is due; an entry of the due set that
-- is not a due hold is moved out of the sweep's way or dropped (below).
if EPOCH == '' then
  return reply('closed')
end
if foreign() then
  return refuse_foreign()
end
if expire_if_due(now_ms()) then
  return answer('expired')
end
-- An entry of the due set whose hold is no longer held here (its marker gone,
-- another sale's, or confirmed / cancelled / expired) would stay at the head of
-- the set for ever and stop the sweep of every hold behind it: it is dropped.
-- Nothing is counted back: what the marker held is the ledger repair's business.
if redis.call('EXISTS', K.marker) == 0 then
  -- The marker is gone (evicted, say) while Redis still counts the hold: the entry
  -- stays as that evidence, a minute later, and the ledger's repair replays the
  -- hold's end, which returns its units (replay.lua) and removes the entry.
  redis.call('ZADD', K.holds, now_ms() + 60000, KEY)
  return answer('marker_missing')
end
if settling() then
  -- Its confirm or cancel decides; the resolver finishes or aborts it.
  return answer('not_due')
end
local state = ours() and redis.call('HGET', K.marker, 'state')
if state ~= 'active' and state ~= 'pending' then
  -- Confirmed, cancelled, expired or another sale's: its units are where they
  -- belong; only the entry is stale.
  redis.call('ZREM', K.holds, KEY)
  return answer('stale_entry')
end
return answer('not_due')
