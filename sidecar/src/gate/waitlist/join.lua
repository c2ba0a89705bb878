-- join: ARGV[3] user, ARGV[4] quantity, ARGV[5] variant ('' for none), ARGV[6] the
-- attempt, ARGV[7] its bound (ms): past it a join still not durable is resolved
-- from the ledger.
--
-- In one atomic step: the mode and the gate, the sale's ledger, the key (a retry
-- hears its entry; a key that names a reservation or another entry is reused),
-- the waitlist, the variant, the sale window, the per-user limit (held and waiting
-- units together), the line's length; then the entry joins the end of its line as
-- 'joining' with the next position, its units counted as waiting.
local cfg = redis.call('HMGET', K.config, 'mode', 'perUserLimit', 'startsAt', 'endsAt', 'waitlist',
  'variants', 'expireAt', 'generation')
if not cfg[1] then
  return wl_reply('not_found')
end
if cfg[1] ~= 'gate' then
  return wl_reply('mode', '', '', '', '', '', cfg[1])
end
local early = wl_before()
if early then
  return early
end
local user, quantity, variant = ARGV[3], tonumber(ARGV[4]), ARGV[5]
local now = now_ms()
local e = entry()
if e then
  if e.user == user and e.quantity == quantity and e.variant == variant then
    if e.state == 'joining' then
      if e.overdue_at <= now then
        return entry_reply('overdue')
      end
      return entry_reply('pending')
    end
    return entry_reply('already')
  end
  return wl_reply('idempotency_key_reused')
end
if ours() then
  -- The key names a reservation: a place in line needs a key of its own.
  return wl_reply('idempotency_key_reused')
end
if not cfg[5] or cfg[5] == '' then
  return wl_reply('waitlist_disabled')
end
VARIANTS = cfg[6] or ''
if variant == '' and VARIANTS ~= '' then
  return wl_reply('variant_missing')
end
if variant ~= '' and VARIANTS == '' then
  return wl_reply('variant_unexpected', '', '', '', '', variant)
end
if variant ~= '' and not string.find(',' .. VARIANTS, ',' .. variant .. '=', 1, true) then
  return wl_reply('unknown_variant', '', '', '', '', variant)
end
if cfg[3] ~= '' and now < tonumber(cfg[3]) then
  return wl_reply('not_open', '', '', '', '', '', cfg[3])
end
if cfg[4] ~= '' and now >= tonumber(cfg[4]) then
  return wl_reply('ended', '', '', '', '', '', cfg[4])
end
local counted = tonumber(redis.call('HGET', K.buyers, user) or '0') + waiting_units(user)
if counted + quantity > tonumber(cfg[2]) then
  return wl_reply('per_user_limit_exceeded', user, tostring(counted), '', '', '', cfg[2])
end
local line = wl_line(variant)
if redis.call('ZCARD', line) >= tonumber(cfg[5]) then
  return wl_reply('waitlist_full', '', '', '', '', variant, cfg[5])
end
local position = redis.call('INCR', wl_prefix() .. 'n')
redis.call('DEL', wl_entry(KEY))
redis.call('HSET', wl_entry(KEY), 'state', 'joining', 'user', user, 'quantity', quantity,
  'variant', variant, 'position', position, 'attempt', ARGV[6], 'sale', SALE,
  'overdueAt', now + tonumber(ARGV[7]), 'joinedAt', now)
redis.call('ZADD', line, position, KEY)
redis.call('HINCRBY', wl_users(), user, quantity)
if cfg[7] and cfg[7] ~= '' then
  -- With the drop's other keys (never in the past: see reserve.lua).
  local at = math.max(tonumber(cfg[7]), now + 3600 * 1000)
  for _, key in ipairs({wl_entry(KEY), line, wl_users(), wl_prefix() .. 'n'}) do
    redis.call('PEXPIREAT', key, at)
  end
end
-- With the config's generation: a join decided on a config Redis lost is not
-- recorded (service::waitlist::make_durable).
return entry_reply('joining', cfg[8] or '')
