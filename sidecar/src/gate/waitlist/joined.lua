-- joined: the join ARGV[3] is durable in the ledger: its entry waits in line.
-- Anything else is answered as the entry stands ('gone').
local e = entry()
if e and e.state == 'joining' and e.attempt == ARGV[3] then
  redis.call('HSET', wl_entry(KEY), 'state', 'waiting')
  redis.call('HDEL', wl_entry(KEY), 'overdueAt')
  return entry_reply('joined')
end
return entry_reply('gone')
