-- activate: the admission ARGV[2] got its throttle permit and is durable in the
-- ledger; its pending marker becomes an active reservation. Anything else (expired
-- meanwhile, or already activated by a replay from the ledger) is reported as it is.
local m = redis.call('HMGET', K.marker, 'attempt', 'state')
if not ours() or m[1] ~= ARGV[2] then
  return answer('gone')
end
if m[2] == 'pending' then
  redis.call('HSET', K.marker, 'state', 'active')
  return answer('admitted')
elseif m[2] == 'active' then
  return answer('admitted')
end
return answer('gone')
