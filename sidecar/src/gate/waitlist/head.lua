-- head: the first entry of the line of ARGV[3] (the variant, '' for none) and
-- what that variant may still admit: the sweeper offers it when it fits.
local early = wl_before()
if early then
  return early
end
local first = redis.call('ZRANGE', wl_line(ARGV[3]), 0, 0)[1]
if not first then
  return wl_reply('empty')
end
KEY = first
local e = entry()
if not e then
  -- An entry gone (evicted, another sale's): its line slot is dropped, as the due
  -- set's entries are (see expire.lua).
  redis.call('ZREM', wl_line(ARGV[3]), first)
  return wl_reply('stale', '', '', '', '', '', first)
end
local left = tonumber(redis.call('GET', K.remaining) or '0')
if ARGV[3] ~= '' then
  -- Less what the other sizes' heads have set aside (see reserve.lua).
  VARIANTS = redis.call('HGET', K.config, 'variants') or ''
  left = math.min(left - set_aside(ARGV[3], e.position or math.huge),
    tonumber(redis.call('HGET', K.variants, 'r:' .. ARGV[3]) or '0'))
end
-- detail: what is left, whether a join is past its bound, the key.
local overdue = '0'
if e.state == 'joining' and e.overdue_at <= now_ms() then
  overdue = '1'
end
return wl_reply('head', e.user, tostring(e.quantity), e.state, '1', e.variant,
  tostring(left) .. ' ' .. overdue .. ' ' .. first, tostring(e.position), e.attempt)
