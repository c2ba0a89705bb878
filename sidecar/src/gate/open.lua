-- open: opens the gate at epoch ARGV[2] once Redis holds everything the ledger
-- recorded, and raises the change counter to at least ARGV[3] (the ledger's highest
-- change number), so numbers handed out from now on are new to the ledger. An epoch
-- only grows: a gate already open at ARGV[2] or later is left as it is.
-- Returns the gate's epoch after the call.
local epoch = tonumber(ARGV[2])
if redis.call('EXISTS', K.config) == 0 then
  return reply('not_found')
end
if tonumber(redis.call('GET', K.seq) or '0') < tonumber(ARGV[3]) then
  redis.call('SET', K.seq, ARGV[3])
end
if LOST then
  return reply('lost')
end
if EPOCH ~= '' and tonumber(EPOCH) >= epoch then
  return reply('open')
end
redis.call('SET', K.gate, epoch)
local ttl = redis.call('PTTL', K.config)
if ttl > 0 then
  redis.call('PEXPIRE', K.gate, ttl)
  redis.call('PEXPIRE', K.seq, ttl)
end
EPOCH = tostring(epoch)
return reply('opened')
