-- activate: the admission ARGV[3] got its throttle permit and is durable in the
-- ledger; its pending marker becomes an active reservation. Anything else is
-- reported as it is: `gone` with the marker as it stands (expired meanwhile, taken
-- for dead and admitted afresh by a retry, activated by a replay from the ledger,
-- or no marker at all).
local m = redis.call('HMGET', K.marker, 'attempt', 'state')
if not ours() then
  return answer('gone')
end
if m[2] == 'pending' and m[1] == ARGV[3] then
  redis.call('HSET', K.marker, 'state', 'active')
  redis.call('ZREM', K.unresolved, KEY)
  local listed = redis.call('HMGET', K.marker, 'user', 'admittedAt')
  list_for_buyer(listed[1], tonumber(listed[2]) or now_ms())
  if redis.call('HEXISTS', K.marker, 'line') == 1 then
    redis.call('HSET', wl_entry(KEY), 'state', 'offered')
  end
  return answer('admitted')
end
return answer('gone')
