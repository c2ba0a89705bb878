-- Publishes a drop's config and seeds or restocks its stock, in one atomic step.
--
-- KEYS[1] config hash, KEYS[2] remaining, KEYS[3..] the drop's other state keys
--   (gate, held, buyers, holds, pending, seq, ledger, the deletion tombstone,
--   the variants' stock, the reservations by buyer)
-- ARGV[1] the new limit
-- ARGV[2] when the keys expire (ms since the epoch), or '' to keep them
-- ARGV[3] the sale's identity (the object's uid, or a fixed word outside Kubernetes)
-- ARGV[4] when the object was created (ms since the epoch), or '' outside Kubernetes
-- ARGV[5] the sale's ledger as the drop's status keeps it, or '' when none yet
-- ARGV[6..] the config hash's field/value pairs (limit and sale among them)
--
-- Fresh stock is SET NX, so stock in use is never overwritten. When the config hash
-- already holds a limit, remaining moves by the difference to the new one: a repeat
-- of the same limit moves nothing. Each variant's stock (KEYS[11], `r:<name>`)
-- moves the same way by the difference of its quantity (a variant not in the
-- config counts as quantity 0: one removed keeps its holds and sells nothing more). A cut below what is held makes remaining
-- negative on purpose: the gate then admits nothing, and returned units pay the
-- deficit back before anything is sold again.
--
-- A different sale under the same name (the object was deleted and re-created)
-- starts over: its stock, counts and gate are new, and the gate scripts ignore
-- reservation markers that carry another sale.
--
-- Writers are ordered, so a stale one can never roll a drop back or wipe it; each
-- of these changes nothing and fails with STALE:
-- - a lower generation of the same sale (a replica that lost its Lease);
-- - an unversioned write (apply -f, generation 0) over a sale the API server
--   versions, and a versioned one over a sale apply -f stamped;
-- - another sale created before the published one (an old incarnation of a
--   re-created drop), or any unversioned sale over one Kubernetes created.
--
-- Returns {created (0/1), moved, previous mode or '', remaining after}.
local new_limit = tonumber(ARGV[1])
local old_sale = redis.call('HGET', KEYS[1], 'sale')
local sale = ARGV[3]
local old_limit = redis.call('HGET', KEYS[1], 'limit')
local old_mode = redis.call('HGET', KEYS[1], 'mode') or ''
local old_generation = redis.call('HGET', KEYS[1], 'generation')
local old_variants = redis.call('HGET', KEYS[1], 'variants') or ''
-- The terms a fallback decides on besides the stock: a change of them alone is a
-- new generation too (outside Kubernetes, below), so that the ledgers keep it.
local TERMS = {'perUserLimit', 'startsAt', 'endsAt', 'holdSeconds', 'maxHoldSeconds', 'paused'}
local old_terms = redis.call('HMGET', KEYS[1], unpack(TERMS))
local generation_in = 0
local new_variants = ''
for i = 6, #ARGV - 1, 2 do
  if ARGV[i] == 'generation' then
    generation_in = tonumber(ARGV[i + 1]) or 0
  elseif ARGV[i] == 'variants' then
    new_variants = ARGV[i + 1]
  end
end
-- `name=quantity,...` as a table.
local function quantities(field)
  local out = {}
  for name, quantity in string.gmatch(field, '([^,=]+)=(%d+)') do
    out[name] = tonumber(quantity)
  end
  return out
end
local created_in = tonumber(ARGV[4]) or 0
local old_created = tonumber(redis.call('HGET', KEYS[1], 'saleCreatedAt') or '0') or 0
-- Generations below this come from the API server; above, they are seed times.
local STAMPED = 1e12
local function stale(why)
  return redis.error_reply('STALE ' .. why)
end
if old_sale and old_sale ~= sale then
  if created_in > 0 and old_created > created_in then
    return stale('sale ' .. sale .. ' was created before the published sale ' .. old_sale)
  end
  if created_in == 0 and old_created > 0 then
    return stale('sale ' .. old_sale .. ' is managed through the Kubernetes API: this write would start it over')
  end
elseif old_sale == sale and old_generation then
  local published = tonumber(old_generation) or 0
  if generation_in > 0 and published < STAMPED and published > generation_in then
    return stale('generation ' .. generation_in .. ' is older than the published generation ' .. old_generation)
  end
  if generation_in > 0 and published >= STAMPED then
    return stale('generation ' .. generation_in .. ' cannot follow what apply -f published (generation ' .. old_generation .. '): re-create the drop')
  end
  if generation_in == 0 and published > 0 and published < STAMPED then
    return stale('the drop is managed through the Kubernetes API at generation ' .. old_generation .. ': apply -f cannot change it')
  end
end
if old_sale and old_sale ~= sale then
  for i = 2, #KEYS do
    redis.call('DEL', KEYS[i])
  end
  old_limit = nil
end
local created = 0
local moved = 0
local new_q, old_q = quantities(new_variants), quantities(old_variants)
if redis.call('SET', KEYS[2], new_limit, 'NX') then
  created = 1
  redis.call('DEL', KEYS[11])
  for name, quantity in pairs(new_q) do
    redis.call('HSET', KEYS[11], 'r:' .. name, quantity, 'h:' .. name, 0)
  end
elseif old_limit then
  moved = new_limit - tonumber(old_limit)
  if moved ~= 0 then
    redis.call('INCRBY', KEYS[2], moved)
  end
  for name, quantity in pairs(new_q) do
    local by = quantity - (old_q[name] or 0)
    if by ~= 0 then
      redis.call('HINCRBY', KEYS[11], 'r:' .. name, by)
    end
  end
  for name, quantity in pairs(old_q) do
    if not new_q[name] and quantity ~= 0 then
      redis.call('HINCRBY', KEYS[11], 'r:' .. name, -quantity)
    end
  end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
local new_terms = redis.call('HMGET', KEYS[1], unpack(TERMS))
local terms_moved = false
for i = 1, #TERMS do
  if (old_terms[i] or '') ~= (new_terms[i] or '') then
    terms_moved = true
  end
end
-- Published (again): not a deleted drop any more.
redis.call('DEL', KEYS[10])
-- The sale's ledger, as the status keeps it (Kubernetes is durable, Redis may not
-- be): a Redis that lost its data gets it back, so that no other ledger can claim a
-- sale whose record is elsewhere; the status is the truth where the two differ.
if ARGV[5] ~= '' then
  redis.call('SET', KEYS[9], ARGV[5])
end
if created_in > 0 then
  redis.call('HSET', KEYS[1], 'saleCreatedAt', created_in)
else
  redis.call('HDEL', KEYS[1], 'saleCreatedAt')
end
-- Outside Kubernetes there is no metadata.generation (it is published as 0). The
-- ledgers order limit changes by generation, so a manifest's limit change gets one
-- that only grows: the seed time, also across a Redis that lost its data.
if redis.call('HGET', KEYS[1], 'generation') == '0' then
  local t = redis.call('TIME')
  local generation = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  -- A restock of one variant against a cut of another moves no total, yet the
  -- ledgers must see the variants' new quantities: a new generation too; so must
  -- they a pause, a new end or a new per-user limit alone.
  if created == 0 and moved == 0 and old_variants == new_variants and not terms_moved
      and old_generation then
    generation = old_generation
  end
  redis.call('HSET', KEYS[1], 'generation', generation)
end
if created == 1 then
  -- Fresh stock (a new drop, or a Redis that lost its data in a failover). The gate
  -- key went with it, so no sidecar admits until one has rebuilt the drop from its
  -- ledger and opened the gate again.
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'seededAt', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
-- A sale that ended long ago keeps its keys an hour past each reconcile (a
-- PEXPIREAT in the past would delete them at once): while the InventoryDrop exists
-- its keys do, and the finalizer removes them with it.
local expire_at = nil
if ARGV[2] ~= '' then
  local t = redis.call('TIME')
  expire_at = math.max(tonumber(ARGV[2]), tonumber(t[1]) * 1000 + 3600 * 1000)
end
for _, key in ipairs(KEYS) do
  if expire_at then
    redis.call('PEXPIREAT', key, expire_at)
  else
    redis.call('PERSIST', key)
  end
end
return {created, moved, old_mode, tonumber(redis.call('GET', KEYS[2]) or '0')}
