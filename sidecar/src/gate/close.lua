-- close: closes the gate before the drop's authority moves to epoch ARGV[3] (the
-- ledger's fallback, or a replay that opens the gate again at that epoch), so that
-- no new decision is made in Redis while it does: reserve, confirm, cancel, look-up
-- and expiry answer 'closed' (the follow-ups of changes already decided — activate,
-- undo, finish, abort, abandon — and the replay itself still run). The
-- gate key keeps that epoch, so that a sidecar that began opening the gate at an
-- older epoch (before the move) can no longer open it (see open.lua). A gate already
-- reopened at a later epoch is left open. Only the sale's ledger closes it.
if foreign() then
  return refuse_foreign()
end
local epoch = tonumber(ARGV[3])
if EPOCH ~= '' and tonumber(EPOCH) > epoch then
  return reply('open')
end
redis.call('SET', K.gate, 'closed:' .. math.max(epoch, CLOSED_AT))
local ttl = redis.call('PTTL', K.config)
if ttl > 0 then
  redis.call('PEXPIRE', K.gate, ttl)
end
EPOCH = ''
return reply('closed')
