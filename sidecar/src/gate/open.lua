-- open: opens the gate at epoch ARGV[3] once Redis holds everything the ledger
-- recorded, and raises the change counter to at least ARGV[4] (the ledger's highest
-- change number), so numbers handed out from now on are new to the ledger. An epoch
-- only grows: a gate already open at ARGV[3] or later is left as it is. Only the
-- sale's ledger opens it (claim.lua made it the sale's first). A gate closed for a
-- move to a later epoch than ARGV[3] stays closed ('fenced'): this opening was begun
-- on a view of the ledger that the move made stale.
-- Returns the gate's epoch after the call.
local epoch = tonumber(ARGV[3])
if redis.call('EXISTS', K.config) == 0 then
  return reply('not_found')
end
if foreign() then
  return refuse_foreign()
end
if tonumber(redis.call('GET', K.seq) or '0') < tonumber(ARGV[4]) then
  redis.call('SET', K.seq, ARGV[4])
end
if EPOCH ~= '' and tonumber(EPOCH) >= epoch then
  return reply('open')
end
if CLOSED_AT > epoch then
  return reply('fenced')
end
redis.call('SET', K.gate, epoch)
local ttl = redis.call('PTTL', K.config)
if ttl > 0 then
  redis.call('PEXPIRE', K.gate, ttl)
  redis.call('PEXPIRE', K.seq, ttl)
end
EPOCH = tostring(epoch)
return reply('opened')
