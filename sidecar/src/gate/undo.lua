-- undo: takes back an admission as if it never happened — stock, buyer count, the
-- marker itself — so a retry of the same key can be admitted. ARGV[2] is the attempt
-- id written by reserve: only that admission is undone, and only while it is still
-- pending (an expiry that came first already returned it). Its change number stays
-- used: the ledger never recorded it, so the gap means nothing.
local m = redis.call('HMGET', K.marker, 'attempt', 'state', 'user', 'quantity')
if not ours() or m[1] ~= ARGV[2] or m[2] ~= 'pending' then
  return answer('gone')
end
take_back(m[3], tonumber(m[4]))
return reply('undone', '', '', '', '', tostring(remaining()))
