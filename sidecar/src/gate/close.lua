-- close: closes the gate before the ledger takes authority over the drop, so that
-- nothing changes in Redis while it does: every gate script answers 'closed'. A gate
-- already reopened at a later epoch than ARGV[2] is left open. ARGV[3] 'lost' leaves
-- the tombstone instead, which no sidecar opens again.
if EPOCH ~= '' and tonumber(EPOCH) > tonumber(ARGV[2]) then
  return reply('open')
end
if LOST then
  return reply('lost')
end
if ARGV[3] == 'lost' then
  -- The tombstone (see the prelude): it lives as long as the drop's config.
  redis.call('SET', K.gate, 'lost')
  local ttl = redis.call('PTTL', K.config)
  if ttl > 0 then
    redis.call('PEXPIRE', K.gate, ttl)
  end
  return reply('lost')
end
redis.call('DEL', K.gate)
EPOCH = ''
return reply('closed')
