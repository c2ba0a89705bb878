-- reserve: ARGV[3] user, ARGV[4] quantity, ARGV[5] attempt id, ARGV[6] the pending
-- bound (ms): how long an admission may stay pending before it is overdue (its
-- permit wait plus the ledger's commit deadline), ARGV[7] the variant ('' for a
-- drop without variants): its stock and the drop's must both hold the quantity.
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
  'variants', 'paused')
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

if ours() then
  local owner = redis.call('HMGET', K.marker, 'user', 'quantity', 'variant')
  if owner[1] == user and tonumber(owner[2]) == quantity and (owner[3] or '') == variant then
    expire_if_due(now)
    if not granted() then
      if redis.call('HGET', K.marker, 'state') == 'pending'
        and tonumber(redis.call('HGET', K.marker, 'overdueAt')) <= now then
        -- Its sidecar never finished it (it died): the caller resolves it from the
        -- ledger as the sweeper would (the reservation the ledger holds, or its
        -- units back to stock) and asks again, so that a retry is decided on the
        -- config as it is now.
        return answer('overdue')
      end
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
if bought + quantity > tonumber(cfg[2]) then
  return reply('per_user_limit_exceeded', user, tostring(bought), '', cfg[2],
    tostring(remaining()))
end

-- The drop's count pays a cut back first; with a variant, the variant's too.
local left = remaining(variant)
if left < quantity then
  return reply('sold_out', '', '', '', '', tostring(left), variant)
end

local deadline = now + tonumber(cfg[5]) * 1000
take(user, quantity, variant)
redis.call('ZADD', K.holds, deadline, KEY)
redis.call('DEL', K.marker)
redis.call('HSET', K.marker, 'user', user, 'quantity', quantity, 'state', 'pending',
  'expiresAt', deadline, 'attempt', attempt, 'sale', SALE, 'overdueAt', now + bound,
  'admittedAt', now)
if variant ~= '' then
  redis.call('HSET', K.marker, 'variant', variant)
end
redis.call('ZADD', K.unresolved, now + bound, KEY)
bump()
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
return answer('admitted')
