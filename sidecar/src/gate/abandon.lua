-- abandon (the sweeper, or a retry of the key): an admission still pending past its
-- bound was left by a sidecar that died before making it durable: its units go back
-- as if it never happened. Only a sidecar of the sale's ledger may judge that (it
-- has claimed the key in that ledger for ARGV[3], the attempt, first, so a late
-- commit is refused). One admitted afresh meanwhile (another attempt, its own
-- bound) is left alone, due at its bound. One expired while pending meanwhile
-- ('unsure': its units went back then) only loses its marker. An empty ARGV[3] only
-- clears the entry of a key with nothing unresolved.
if foreign() then
  return refuse_foreign()
end
local m = redis.call('HMGET', K.marker, 'state', 'overdueAt', 'user', 'quantity', 'attempt')
if ours() and m[1] == 'expired' and m[5] == ARGV[3] and ARGV[3] ~= ''
  and redis.call('HGET', K.marker, 'unsure') == '1' then
  -- Expired while pending after the caller read it pending (its units went back
  -- then) and claimed it: only the marker goes, as undo.lua does.
  redis.call('ZREM', K.unresolved, KEY)
  redis.call('DEL', K.marker)
  return answer('not_pending')
end
if not ours() or m[1] ~= 'pending' or ARGV[3] == '' then
  if not (ours() and (settling() or m[1] == 'pending')) then
    redis.call('ZREM', K.unresolved, KEY)
  end
  return answer('not_pending')
end
if m[5] ~= ARGV[3] or tonumber(m[2]) > now_ms() then
  redis.call('ZADD', K.unresolved, m[2], KEY)
  return answer('not_overdue')
end
take_back(m[3], tonumber(m[4]))
return reply('abandoned', '', '', '', '', tostring(remaining()))
