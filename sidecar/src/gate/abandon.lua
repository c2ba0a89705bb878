-- abandon (the sweeper): an admission still pending past its bound was left by a
-- sidecar that died before making it durable: its units go back as if it never
-- happened. ARGV[2] is the caller's ledger id: only a sidecar of the ledger that was
-- to record it may judge that (it has claimed the key in that ledger first, so a
-- late commit is refused); another pod leaves it to expire with its hold. One that
-- a retry took over meanwhile (its bound moved) is left alone.
local m = redis.call('HMGET', K.marker, 'state', 'overdueAt', 'user', 'quantity', 'ledger')
if not ours() or m[1] ~= 'pending' or tonumber(m[2]) > now_ms() then
  redis.call('ZREM', K.pending, KEY)
  return answer('not_overdue')
end
if m[5] ~= ARGV[2] then
  redis.call('ZREM', K.pending, KEY)
  return answer('not_ours')
end
take_back(m[3], tonumber(m[4]))
return reply('abandoned', '', '', '', '', tostring(remaining()))
