-- reserve: ARGV[3] user, ARGV[4] quantity, ARGV[5] attempt id, ARGV[6] the pending
-- bound (ms): how long an admission may stay pending before it is overdue (its
-- permit wait plus the ledger's commit deadline), ARGV[7] the variant ('' for a
-- drop without variants): its stock and the drop's must both hold the quantity.
-- ARGV[8] '1': an offer to the head of the variant's waitlist line, under the
-- entry's own key (the sweeper's; see waitlist.lua's notes in gate/waitlist.rs).
--
-- In one atomic step: the mode and the gate, the sale's ledger, the idempotency
-- marker, the sale window, a pause, the per-user limit, the stock; then decrement, count the
-- buyer, write the marker. The marker starts 'pending': the sidecar still has to get
-- a throttle permit and make the admission durable, and then activates it
-- (activate.lua) or takes it back (undo.lua). A duplicate that finds it pending is
-- told so and asks again, so no one is promised a unit that is then undone; one
-- that finds it past its bound is told 'overdue'.
RESERVE_CONFIG = RESERVE_CONFIG or redis.call('HMGET', K.config,
  'mode', 'perUserLimit', 'startsAt', 'endsAt', 'holdSeconds', 'expireAt', 'limit', 'generation',
  'variants', 'paused', 'waitlist')
local cfg = RESERVE_CONFIG
if not cfg[1] then
  return reply('not_found')
end
LIMIT, GENERATION, VARIANTS = cfg[7] or '', cfg[8] or '', cfg[9] or ''
if cfg[1] ~= 'gate' then
  return reply('mode', '', '', cfg[1])
end
if EPOCH == '' then
  return reply('closed')
end
if foreign() then
  return refuse_foreign()
end
local user, quantity, attempt, bound = ARGV[3], tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local variant = ARGV[7]
local now = now_ms()

if ARGV[8] == '1' and ours() and redis.call('HGET', K.marker, 'state') == 'expired'
  and redis.call('HEXISTS', K.marker, 'line') == 1
  and redis.call('HGET', wl_entry(KEY), 'state') == 'waiting' then
  -- An offer that expired while pending put its entry back in line (expire_if_due):
  -- that attempt's marker is nobody's reservation, and the entry is offered afresh
  -- under its key. Had the ledger recorded that offer after all, it refuses this
  -- one, and the sweeper takes the entry out of line (service::waitlist).
  redis.call('DEL', K.marker)
end
if ours() then
  if redis.call('HGET', K.marker, 'unsure') == '1' then
    -- An admission of the key expired while pending, not known to have been made
    -- durable (expire_if_due): resolved from the ledger first, past its bound (its
    -- own sidecar may still finish it before), whoever the caller is.
    if (tonumber(redis.call('HGET', K.marker, 'overdueAt')) or 0) <= now then
      return answer('overdue')
    end
    return answer('pending')
  end
  local owner = redis.call('HMGET', K.marker, 'user', 'quantity', 'variant')
  if owner[1] == user and tonumber(owner[2]) == quantity and (owner[3] or '') == variant then
    if redis.call('HGET', K.marker, 'state') == 'pending'
      and tonumber(redis.call('HGET', K.marker, 'overdueAt')) <= now then
      -- Its sidecar never finished it (it died, or its commit's outcome is
      -- unknown): the caller resolves it from the ledger as the sweeper would (the
      -- reservation the ledger holds, or its units back to stock) and asks again,
      -- so that a retry is decided on the config as it is now. Asked before its
      -- hold may expire it here: expired, an admission never made durable would
      -- read as a reservation ('already_reserved').
      return answer('overdue')
    end
    expire_if_due(now)
    if not granted() or redis.call('HGET', K.marker, 'unsure') == '1' then
      -- (Expired just now while pending, within its bound: its sidecar may still
      -- finish it.)
      return answer('pending')
    end
    if settling() then
      -- Its confirm or cancel is prepared: whether it happened is the ledger's to
      -- say, as for a look-up (the marker's state may be one step behind).
      return answer('settling')
    end
    return answer('already_reserved')
  end
  return reply('idempotency_key_reused', '', '', '', '', tostring(remaining()))
end
-- With a waitlist: a key waiting in a line names that entry, not a new reserve
-- (its offer comes under it); an offer must be to the head of its line, as it
-- stands now.
local lined = cfg[11] and cfg[11] ~= ''
local offer = ARGV[8] == '1'
if lined or offer then
  local e = redis.call('HMGET', wl_entry(KEY), 'state', 'user', 'quantity', 'variant', 'sale')
  if offer then
    if not lined or e[1] ~= 'waiting' or e[5] ~= SALE or e[2] ~= user
      or tonumber(e[3]) ~= quantity or (e[4] or '') ~= ARGV[7]
      or redis.call('ZRANGE', wl_line(ARGV[7]), 0, 0)[1] ~= KEY then
      return reply('not_head')
    end
  elseif e[1] and e[5] == SALE and e[1] ~= 'left' then
    return reply('idempotency_key_reused', '', '', '', '', tostring(remaining()))
  end
end

-- The variant as the config names it now (the caller's copy may be older): one
-- the drop does not have (any more), or none where it has variants, is refused.
-- (After the key: a retry of a reservation hears what it holds whatever the
-- variants are now.)
if variant == '' and VARIANTS ~= '' then
  return reply('variant_missing')
end
if variant ~= '' and VARIANTS == '' then
  return reply('variant_unexpected', '', '', '', '', '', variant)
end
if variant ~= '' and not string.find(',' .. VARIANTS, ',' .. variant .. '=', 1, true) then
  return reply('unknown_variant', '', '', '', '', '', variant)
end

if cfg[3] ~= '' and now < tonumber(cfg[3]) then
  return reply('not_open', '', '', '', cfg[3])
end
if cfg[4] ~= '' and now >= tonumber(cfg[4]) then
  return reply('ended', '', '', '', cfg[4])
end
-- A paused sale admits nothing new; everything already held goes on as it was.
if cfg[10] == '1' then
  return reply('paused')
end

local bought = tonumber(redis.call('HGET', K.buyers, user) or '0')
if lined then
  -- Units the buyer waits for count too; an offer's own are about to be held.
  bought = bought + waiting_units(user)
  if offer then
    bought = bought - quantity
  end
end
if bought + quantity > tonumber(cfg[2]) then
  return reply('per_user_limit_exceeded', user, tostring(bought), '', cfg[2],
    tostring(remaining()))
end

-- The drop's count pays a cut back first; with a variant, the variant's too.
local left = remaining(variant)
-- While anyone waits, what comes back is theirs: a new reserve is sold out.
if lined and not offer and redis.call('EXISTS', wl_line(variant)) == 1 then
  return reply('sold_out', '', '', '', '', '0', variant)
end
if left < quantity then
  return reply('sold_out', '', '', '', '', tostring(left), variant)
end
-- With variants, the drop's own count can be the tighter one (a size cut below
-- what it holds is paid back from every size's returns): units another size's
-- line head needs, which that size has and the drop still counts, are set aside
-- for it, so no buyer outside that line takes them while it waits, nor an offer to
-- another size's line whose head joined after it. (Nothing is set aside in effect
-- while the drop's count is the sum of its sizes': then every size's own count
-- already covers it.)
if lined and variant ~= '' then
  local drop_left = tonumber(redis.call('GET', K.remaining) or '0')
  local before = math.huge
  if offer then
    before = tonumber(redis.call('HGET', wl_entry(KEY), 'position')) or math.huge
  end
  local aside = set_aside(variant, before)
  if drop_left - quantity < aside then
    return reply('sold_out', '', '', '', '', tostring(math.max(0, drop_left - aside)), variant)
  end
end

local deadline = now + tonumber(cfg[5]) * 1000
take(user, quantity, variant)
zadd(K.holds, deadline, KEY)
-- Whatever an earlier sale left under this key, nothing of it carries over.
redis.call('DEL', K.marker)
-- The change's number first, so that the marker is written whole in one HSET.
SEQ = redis.call('INCR', K.seq)
if variant ~= '' then
  redis.call('HSET', K.marker, 'user', user, 'quantity', quantity, 'state', 'pending',
    'expiresAt', deadline, 'attempt', attempt, 'sale', SALE, 'overdueAt', now + bound,
    'admittedAt', now, 'seq', SEQ, 'variant', variant)
else
  redis.call('HSET', K.marker, 'user', user, 'quantity', quantity, 'state', 'pending',
    'expiresAt', deadline, 'attempt', attempt, 'sale', SALE, 'overdueAt', now + bound,
    'admittedAt', now, 'seq', SEQ)
end
if offer then
  -- The entry leaves the line with its units: they are held now (take counted
  -- them for the buyer). Undone, it goes back to its place (back_in_line).
  redis.call('ZREM', wl_line(variant), KEY)
  redis.call('HINCRBY', wl_users(), user, -quantity)
  redis.call('HSET', wl_entry(KEY), 'state', 'offering')
  redis.call('HSET', K.marker, 'line', '1')
end
zadd(K.unresolved, now + bound, KEY)
-- The marker outlives the hold so that a late retry still reads already_reserved;
-- the drop's other keys expire with the config when the sale has an end.
if cfg[6] ~= '' then
  -- Never in the past (an end moved back): that would delete them at once.
  local expire_at = math.max(tonumber(cfg[6]), now + 3600 * 1000)
  expire_shared(expire_at)
  redis.call('PEXPIREAT', K.marker, expire_at)
else
  redis.call('PEXPIREAT', K.marker, deadline + 7 * 86400 * 1000)
end
-- The marker as just written, and what is left once these units are taken.
return shown('admitted', user, tostring(quantity), 'pending', tostring(deadline), variant,
  left - quantity)
