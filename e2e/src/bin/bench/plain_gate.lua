-- The baseline the bench measures the sidecar against: the smallest gate a shop
-- could write by hand, with none of dropgate's bookkeeping (no sale, no ledger,
-- no window, no pending state, no change numbers).
-- KEYS[1] the stock   KEYS[2] the buyer's count   KEYS[3] the request's marker
-- ARGV[1] quantity    ARGV[2] per-user limit      ARGV[3] the marker's lifetime (s)
-- Answers 1 admitted, 0 sold out, 2 a retry of a marked key, 3 over the limit.
if redis.call('EXISTS', KEYS[3]) == 1 then
  return 2
end
local want = tonumber(ARGV[1])
if tonumber(redis.call('GET', KEYS[2]) or '0') + want > tonumber(ARGV[2]) then
  return 3
end
if tonumber(redis.call('GET', KEYS[1]) or '-1') < want then
  return 0
end
redis.call('DECRBY', KEYS[1], want)
redis.call('INCRBY', KEYS[2], want)
redis.call('SET', KEYS[3], '1', 'EX', ARGV[3])
return 1
