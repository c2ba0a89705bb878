-- activate: the admission ARGV[2] got its throttle permit; its pending marker becomes
-- an active reservation. Anything else (expired meanwhile) is reported as it is.
local m = redis.call('HMGET', K.marker, 'attempt', 'state')
if m[1] ~= ARGV[2] or m[2] ~= 'pending' then
  return answer('gone')
end
redis.call('HSET', K.marker, 'state', 'active')
return answer('admitted')
