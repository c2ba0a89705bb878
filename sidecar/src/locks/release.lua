-- release: deletes the lock only for the holder of ARGV[1]. Returns 1, or 0 when
-- someone else holds it (or nobody does).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
