-- close: closes the gate before the ledger takes authority over the drop, so that
-- nothing changes in Redis while it does: every gate script answers 'closed'. A gate
-- already reopened at a later epoch than ARGV[2] is left open. ARGV[3] 'lost' leaves
-- the tombstone instead, whatever the epoch, and no sidecar opens the gate again.
if ARGV[3] == 'lost' then
  redis.call('SET', K.gate, 'lost')
  local ttl = redis.call('PTTL', K.config)
  if ttl > 0 then
    redis.call('PEXPIRE', K.gate, ttl)
  end
  EPOCH = ''
  return reply('lost')
end
if LOST then
  return reply('lost')
end
if EPOCH ~= '' and tonumber(EPOCH) > tonumber(ARGV[2]) then
  return reply('open')
end
redis.call('DEL', K.gate)
EPOCH = ''
return reply('closed')
