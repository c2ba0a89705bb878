-- finish: ARGV[3] the attempt that prepared a confirm, cancel or extension, which
-- the ledger has recorded: it takes effect in Redis. An attempt that no longer matches (a
-- rebuild replayed the ledger's record meanwhile) changes nothing: 'gone'.
--
-- The units follow the state from the one the marker is in now, as a replay's do:
-- a cancel returns them only if the marker still counts them, and a confirm of a
-- marker that no longer does takes them again, so no unit is returned twice and
-- none is held uncounted. (While a change is prepared nothing else moves the
-- marker's state; this keeps it so for a Redis put back from an older copy.) A
-- partial confirm ('settleQuantity' fewer than held) gives the rest back.
local m = redis.call('HMGET', K.marker, 'settling', 'settleAttempt', 'user', 'quantity',
  'settleSeq', 'state', 'settleQuantity')
if not ours() or m[2] ~= ARGV[3] then
  return answer('gone')
end
if m[1] == 'extended' then
  -- An extension: the hold's deadline moves (never back), nothing else.
  local until_ms = tonumber(redis.call('HGET', K.marker, 'settleExpiresAt'))
  clear_settling()
  local at = math.max(tonumber(redis.call('HGET', K.marker, 'expiresAt')), until_ms)
  redis.call('HSET', K.marker, 'expiresAt', at, 'seq', m[5])
  if m[6] == 'active' then
    redis.call('ZADD', K.holds, at, KEY)
  end
  -- A sale without an end keeps a marker a week past its hold (see reserve.lua):
  -- past the new deadline too. With an end, the drop's keys outlive every hold.
  local expire_at = redis.call('HGET', K.config, 'expireAt')
  if not expire_at or expire_at == '' then
    redis.call('PEXPIREAT', K.marker, at + 7 * 86400 * 1000)
  end
  return answer('extended')
end
clear_settling()
redis.call('ZREM', K.holds, KEY)
local target, before, held = m[1], m[6], tonumber(m[4])
local kept = held
if target == 'confirmed' and m[7] and tonumber(m[7]) < held then
  kept = tonumber(m[7])
end
redis.call('HSET', K.marker, 'state', target, 'seq', m[5], 'quantity', kept)
if holds_units(before) and not holds_units(target) then
  give_back(m[3], held, marker_variant())
elseif holds_units(before) and kept < held then
  give_back(m[3], held - kept, marker_variant())
elseif not holds_units(before) and holds_units(target) then
  take(m[3], kept, marker_variant())
end
return answer(target)
