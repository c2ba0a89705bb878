-- claim: ARGV[3] the ledger the caller holds to be the sale's: its own, or the one
-- its ledger remembers Redis naming (a Redis that lost the key gets it back). When
-- the sale has no ledger yet, that one becomes it; the answer says whose the sale
-- is: 'mine', 'awaiting' (the caller's claim, not recorded by the operator yet), or
-- 'foreign' naming the sale's ledger. Where the config says claims are 'recorded',
-- a new claim is provisional ('claimed:<id>'): the operator writes the plain id once
-- the drop's status holds it, and until then no gate script lets anyone change the
-- sale. The key lives as long as the config.
if redis.call('EXISTS', K.config) == 0 then
  return reply('not_found')
end
if OWNER == '' then
  if redis.call('HGET', K.config, 'claims') == 'recorded' then
    OWNER = 'claimed:' .. ARGV[3]
  else
    OWNER = ARGV[3]
  end
  redis.call('SET', K.ledger, OWNER)
  local ttl = redis.call('PTTL', K.config)
  if ttl > 0 then
    redis.call('PEXPIRE', K.ledger, ttl)
  end
end
if OWNER == 'claimed:' .. LEDGER then
  return reply('awaiting', '', '', LEDGER)
end
if foreign() then
  return refuse_foreign()
end
return reply('mine', '', '', OWNER)
