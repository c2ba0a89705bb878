-- unjoin: the join ARGV[3] was not made durable (the ledger refused it, or its
-- claim for a dead attempt won): its entry leaves as if it never joined.
local e = entry()
if e and e.state == 'joining' and e.attempt == ARGV[3] then
  out_of_line(e)
  redis.call('DEL', wl_entry(KEY))
  return wl_reply('unjoined')
end
return entry_reply('gone')
