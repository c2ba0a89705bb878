-- close: closes the gate before the ledger takes authority over the drop, so that
-- nothing changes in Redis while it does: every gate script answers 'closed'. A gate
-- already reopened at a later epoch than ARGV[2] is left open.
if EPOCH ~= '' and tonumber(EPOCH) > tonumber(ARGV[2]) then
  return reply('open')
end
redis.call('DEL', K.gate)
EPOCH = ''
return reply('closed')
