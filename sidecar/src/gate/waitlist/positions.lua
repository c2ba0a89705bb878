-- positions: ARGV[3] the highest position the ledger recorded, joins given up on
-- included (a rebuild, after every entry was replayed). The lines' counter is
-- raised to it, never lowered, keeping its expiry: the replay raises it only past
-- the entries it replays, and a counter left below a given-up join's position
-- would read as behind the ledger at every check (a rebuild each time).
if foreign() then
  return wl_reply('foreign', '', '', '', '', '', OWNER)
end
local counter = wl_prefix() .. 'n'
if tonumber(redis.call('GET', counter) or '0') < tonumber(ARGV[3]) then
  redis.call('SET', counter, ARGV[3], 'KEEPTTL')
end
return wl_reply('none')
