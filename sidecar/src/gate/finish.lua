-- finish: ARGV[3] the attempt that prepared a confirm or cancel, which the ledger
-- has recorded: it takes effect in Redis (a cancel returns its units). An attempt
-- that no longer matches (a rebuild replayed the ledger's record meanwhile) changes
-- nothing: 'gone'.
local m = redis.call('HMGET', K.marker, 'settling', 'settleAttempt', 'user', 'quantity',
  'settleSeq')
if not ours() or m[2] ~= ARGV[3] then
  return answer('gone')
end
clear_settling()
redis.call('ZREM', K.holds, KEY)
redis.call('HSET', K.marker, 'state', m[1], 'seq', m[5])
if m[1] == 'cancelled' then
  give_back(m[3], tonumber(m[4]), marker_variant())
end
return answer(m[1])
