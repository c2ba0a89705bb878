-- replay: brings one reservation in Redis forward to the ledger's record of it
-- (after the fallback path changed it, or to rebuild a Redis that lost writes).
-- ARGV[3] user, ARGV[4] quantity, ARGV[5] the ledger's state, ARGV[6] its deadline
-- (ms), ARGV[7] the ledger's change number for it, ARGV[8] its sale, ARGV[9] its
-- variant ('' for none), ARGV[10] when it was admitted (ms; '' when the ledger
-- does not say).
--
-- Only forward (one exception: `expired_early` below): pending < active < expired <
-- confirmed < cancelled. A marker that
-- is as far as the ledger or further is left alone (`in_line`), so an older ledger
-- never turns a confirmed reservation back to active, and replaying twice changes
-- nothing. A hold expires only while active, so a ledger that has it confirmed or
-- cancelled is further than a marker that expired it (an expiry Redis made that
-- the ledger refused: Redis missed the confirm, a failover or a cut). Units move only when "holds units" changes. A confirm or cancel prepared
-- on the marker is over once the ledger's record is further: the record says how it
-- ended.
-- A sidecar whose ledger is not the sale's changes nothing of it.
if foreign() then
  return refuse_foreign()
end
-- A row of another sale (the drop was re-created since it was read) is not this
-- sale's business.
if ARGV[8] ~= SALE then
  return reply('other_sale')
end
local rank = {pending = 0, active = 1, expired = 2, confirmed = 3, cancelled = 4}
local target = ARGV[5]
local m = {false, false, false, false}
if ours() then
  m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state', 'variant')
end
-- A marker of another reservation under the same key: Redis lost the ledger's,
-- and another admission re-used the key (one the ledger refuses). A reservation's
-- buyer and variant never change; nor, while its marker is behind the ledger's row,
-- does its count (below). Such a marker is never in line, however far it went.
local ledger_quantity = tonumber(ARGV[4])
-- An admission expired while pending ('unsure') of other terms than the row is
-- another too: past its hold, its commit can no longer land.
local unsure = m[3] and redis.call('HGET', K.marker, 'unsure') == '1'
local another = m[3] and (m[1] ~= ARGV[3] or (m[4] or '') ~= ARGV[9]
  or (unsure and tonumber(m[2]) ~= ledger_quantity))
if unsure and not another then
  -- Expired while pending, and the ledger has it: it was made, no longer in doubt.
  redis.call('HDEL', K.marker, 'unsure')
  redis.call('ZREM', K.unresolved, KEY)
end
-- One exception: a hold Redis expired at a deadline the ledger has since moved on
-- from (it extended the hold, and Redis lost the extension in a failover) was
-- never due; the ledger's later deadline stands, and the hold takes its units
-- again.
local expired_early = not another and m[3] == 'expired' and target == 'active'
  and not settling()
  and tonumber(ARGV[6]) > tonumber(redis.call('HGET', K.marker, 'expiresAt') or '0')
if m[3] and not another and (rank[m[3]] or 0) >= rank[target] and not expired_early then
  -- Redis has the ledger's change: its marker says so by its number, which is how
  -- a check after a failover tells a Redis that has the ledger's last change.
  if tonumber(redis.call('HGET', K.marker, 'seq') or '0') < tonumber(ARGV[7]) then
    redis.call('HSET', K.marker, 'seq', ARGV[7])
  end
  -- An active hold the ledger extended (Redis missed the extension's finish): its
  -- deadline moves forward, never back.
  local expires_at = tonumber(redis.call('HGET', K.marker, 'expiresAt') or '0')
  if m[3] == 'active' and target == 'active' and not settling()
    and tonumber(ARGV[6]) > expires_at then
    redis.call('HSET', K.marker, 'expiresAt', ARGV[6])
    redis.call('ZADD', K.holds, ARGV[6], KEY)
    return answer('replayed')
  end
  -- Listed under its buyer as a replayed one is (a marker an older sidecar
  -- activated has no entry yet).
  local admitted = tonumber(redis.call('HGET', K.marker, 'admittedAt') or ARGV[10]) or now_ms()
  list_for_buyer(m[1], admitted)
  return answer('in_line')
end
local user = m[1] or ARGV[3]
local quantity = tonumber(m[2] or ARGV[4])
local variant = m[4] or ARGV[9]
-- A marker that is gone while its key is still in the due or unresolved set (an
-- evicted marker): Redis still counts its units, as for an active hold.
local before = m[3]
if not before and (redis.call('ZSCORE', K.holds, KEY) or redis.call('ZSCORE', K.unresolved, KEY)) then
  before = 'active'
end
-- Behind the ledger's row, a marker of another count is another reservation too
-- (a confirm that kept fewer units than were held is the same one). Toward an
-- expired or cancelled row the count does not matter: the marker gives back what
-- it holds either way.
another = another or (m[3] and ((target == 'active' and quantity ~= ledger_quantity)
  or (target == 'confirmed' and quantity < ledger_quantity)))
if another then
  -- Its units go back as it holds them (its own variant), an offer it was goes back
  -- to its place in line, it is no reservation of its buyer's, and the ledger's
  -- reservation takes its place whole: buyer, variant and count.
  if holds_units(before) then
    give_back(user, quantity, m[4] or '')
  end
  if before == 'pending' and redis.call('HEXISTS', K.marker, 'line') == 1 then
    back_in_line(KEY)
  end
  local listed = tonumber(redis.call('HGET', K.marker, 'admittedAt') or '')
  if listed then
    unlist_for_buyer(user, listed)
  end
  before = nil
  user, quantity, variant = ARGV[3], ledger_quantity, ARGV[9]
end
-- A confirm keeps the ledger's quantity (a partial confirm kept fewer than were
-- held): Redis counts what it counted before, the ledger's count after.
local kept = quantity
if target == 'confirmed' then
  kept = math.min(quantity, ledger_quantity)
end
if holds_units(before) and not holds_units(target) then
  give_back(user, quantity, variant)
elseif holds_units(before) and kept < quantity then
  give_back(user, quantity - kept, variant)
elseif not holds_units(before) and holds_units(target) then
  take(user, kept, variant)
end
quantity = kept
if not m[3] or another then
  redis.call('DEL', K.marker)
end
local admitted = tonumber(redis.call('HGET', K.marker, 'admittedAt') or ARGV[10]) or now_ms()
redis.call('HSET', K.marker, 'user', user, 'quantity', quantity, 'state', target,
  'expiresAt', ARGV[6], 'sale', SALE, 'seq', ARGV[7], 'admittedAt', admitted)
list_for_buyer(user, admitted)
if variant ~= '' then
  redis.call('HSET', K.marker, 'variant', variant)
end
clear_settling()
-- An offer the ledger recorded: its entry is served, whether the marker was still
-- pending here or Redis had lost it meanwhile. (An entry Redis put back in line
-- is not touched here: a key reused after its marker lapsed could name another
-- reservation; the sweeper asks the ledger's row of the entry when it meets it at
-- the head, service::waitlist::follow_ledger.)
local e = redis.call('HMGET', wl_entry(KEY), 'state', 'sale')
if e[1] == 'offering' and e[2] == SALE then
  redis.call('HSET', wl_entry(KEY), 'state', 'offered')
end
if target == 'active' then
  redis.call('ZADD', K.holds, ARGV[6], KEY)
else
  redis.call('ZREM', K.holds, KEY)
end
local expire_at = redis.call('HGET', K.config, 'expireAt')
if expire_at and expire_at ~= '' then
  -- A sale whose end was moved into the past keeps its markers as the seed keeps
  -- its keys (an hour past now at least): a PEXPIREAT in the past would delete the
  -- marker it just wrote, and the next replay would count its units again.
  redis.call('PEXPIREAT', K.marker, math.max(tonumber(expire_at), now_ms() + 3600 * 1000))
  -- The buyers' index lives as long as the drop's keys (it may be new here).
  redis.call('PEXPIREAT', K.by_buyer, math.max(tonumber(expire_at), now_ms() + 3600 * 1000))
else
  redis.call('PEXPIREAT', K.marker, tonumber(ARGV[6]) + 7 * 86400 * 1000)
end
return answer('replayed')
