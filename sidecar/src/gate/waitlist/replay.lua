-- replay (waitlist): brings KEY's entry in Redis forward to the ledger's record of
-- it (a rebuild after Redis lost writes). ARGV[3] user, ARGV[4] quantity, ARGV[5]
-- variant, ARGV[6] the ledger's state (waiting, offered, left), ARGV[7] position,
-- ARGV[8] the row's sale.
--
-- Only forward: joining < waiting < offering < offered, left. An entry as far or
-- further is left alone; units move only when "in line" changes. The line's
-- counter is raised past the position, so a later join never goes ahead of it.
if foreign() then
  return wl_reply('foreign', '', '', '', '', '', OWNER)
end
if ARGV[8] ~= SALE then
  return wl_reply('other_sale')
end
local rank = {joining = 0, waiting = 1, offering = 2, offered = 3, left = 3}
local target = ARGV[6]
local counter = wl_prefix() .. 'n'
if tonumber(redis.call('GET', counter) or '0') < tonumber(ARGV[7]) then
  redis.call('SET', counter, ARGV[7])
end
local e = entry()
if e and rank[e.state] >= rank[target] and not (e.state == 'joining' and target == 'waiting') then
  return entry_reply('in_line')
end
if e and (e.state == 'joining' or e.state == 'waiting') then
  if target == 'waiting' then
    redis.call('HSET', wl_entry(KEY), 'state', 'waiting')
    redis.call('HDEL', wl_entry(KEY), 'overdueAt')
    return entry_reply('replayed')
  end
  out_of_line(e)
  redis.call('HSET', wl_entry(KEY), 'state', target)
  return entry_reply('replayed')
end
if e then
  -- offering -> offered or left: its units are the offer's reservation's.
  redis.call('HSET', wl_entry(KEY), 'state', target)
  return entry_reply('replayed')
end
redis.call('DEL', wl_entry(KEY))
redis.call('HSET', wl_entry(KEY), 'state', target, 'user', ARGV[3], 'quantity', ARGV[4],
  'variant', ARGV[5], 'position', ARGV[7], 'attempt', '', 'sale', SALE)
if target == 'waiting' then
  redis.call('ZADD', wl_line(ARGV[5]), ARGV[7], KEY)
  redis.call('HINCRBY', wl_users(), ARGV[3], ARGV[4])
end
return entry_reply('replayed')
