-- leave: the ledger has KEY's entry as left (it recorded the buyer leaving, or the
-- entry could not be served): Redis follows. An entry in line leaves it with its
-- waiting units; one being offered is marked left, so that the offer, whose
-- record the ledger refuses, does not put it back in line; a served one stays.
local early = wl_before()
if early then
  return early
end
local e = entry()
if not e then
  return wl_reply('none')
end
if e.state == 'joining' or e.state == 'waiting' then
  out_of_line(e)
  redis.call('HSET', wl_entry(KEY), 'state', 'left')
  redis.call('HDEL', wl_entry(KEY), 'overdueAt')
elseif e.state == 'offering' then
  redis.call('HSET', wl_entry(KEY), 'state', 'left')
end
return entry_reply('found')
