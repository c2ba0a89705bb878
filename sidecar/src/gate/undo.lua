-- undo: takes back an admission as if it never happened — stock, buyer count, the
-- marker itself — so a retry of the same key can be admitted. ARGV[3] is the attempt
-- id written by reserve: only that admission is undone, and only while it is still
-- pending (an expiry that came first already returned it), or, expired while
-- pending and `unsure` (expire_if_due gave its units back), only its marker goes.
-- Its change number stays used: the ledger never recorded it, so the gap means nothing.
-- ARGV[4], when not empty: the epoch of the rebuild that takes the admission back
-- (the ledger never recorded it and its epoch is over). Only while that rebuild
-- still holds the gate closed for its epoch: one overtaken by another sidecar's
-- rebuild (the gate reopened, or closed for a later epoch) would take back a live
-- admission of the new epoch.
local m = redis.call('HMGET', K.marker, 'attempt', 'state', 'user', 'quantity')
local unsure = ours() and not foreign() and m[1] == ARGV[3] and m[2] == 'expired'
  and redis.call('HGET', K.marker, 'unsure') == '1'
if not unsure and (not ours() or m[1] ~= ARGV[3] or m[2] ~= 'pending') then
  return answer('gone')
end
if ARGV[4] ~= '' and (EPOCH ~= '' or CLOSED_AT ~= tonumber(ARGV[4])) then
  return answer('gone')
end
if unsure then
  -- Expired while pending (its units went back then), and never made durable: the
  -- marker goes, so that a retry of the key is decided afresh.
  redis.call('ZREM', K.unresolved, KEY)
  redis.call('DEL', K.marker)
  return answer('gone')
end
take_back(m[3], tonumber(m[4]))
return reply('undone', '', '', '', '', tostring(remaining()))
