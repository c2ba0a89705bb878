-- abandon (the sweeper): an admission still pending past its bound, which the
-- ledger has not recorded, was left by a sidecar that died before making it
-- durable: its units go back as if it never happened. One that a retry took over
-- meanwhile (its bound moved) is left alone.
local m = redis.call('HMGET', K.marker, 'state', 'overdueAt', 'user', 'quantity')
if not ours() or m[1] ~= 'pending' or tonumber(m[2]) > now_ms() then
  redis.call('ZREM', K.pending, KEY)
  return answer('not_overdue')
end
take_back(m[3], tonumber(m[4]))
return reply('abandoned', '', '', '', '', tostring(remaining()))
