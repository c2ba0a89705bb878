-- finish: ARGV[3] the attempt that prepared a confirm or cancel, which the ledger
-- has recorded: it takes effect in Redis. An attempt that no longer matches (a
-- rebuild replayed the ledger's record meanwhile) changes nothing: 'gone'.
--
-- The units follow the state from the one the marker is in now, as a replay's do:
-- a cancel returns them only if the marker still counts them, and a confirm of a
-- marker that no longer does takes them again, so no unit is returned twice and
-- none is held uncounted. (While a change is prepared nothing else moves the
-- marker's state; this keeps it so for a Redis put back from an older copy.)
local m = redis.call('HMGET', K.marker, 'settling', 'settleAttempt', 'user', 'quantity',
  'settleSeq', 'state')
if not ours() or m[2] ~= ARGV[3] then
  return answer('gone')
end
clear_settling()
redis.call('ZREM', K.holds, KEY)
local target, before = m[1], m[6]
redis.call('HSET', K.marker, 'state', target, 'seq', m[5])
if holds_units(before) and not holds_units(target) then
  give_back(m[3], tonumber(m[4]), marker_variant())
elseif not holds_units(before) and holds_units(target) then
  take(m[3], tonumber(m[4]), marker_variant())
end
return answer(target)
