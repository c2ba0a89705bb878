-- Shared by every gate script (concatenated in front of each at compile time).
--
-- Every script takes the same keys, all in the drop's one hash slot:
--   KEYS[1] config   KEYS[2] remaining   KEYS[3] held   KEYS[4] buyers
--   KEYS[5] holds    KEYS[6] the reservation marker     KEYS[7] gate (its epoch)
--   KEYS[8] seq      KEYS[9] the sale's ledger          KEYS[10] unresolved changes
--   KEYS[11] the variants' stock                      KEYS[12] reservations by buyer
-- and ARGV[1], the idempotency key, and ARGV[2], the id of the caller's ledger.
--
-- Every script answers outcome, user, quantity, state, expiresAt, remaining, seq,
-- epoch, expiredSeq, expiredFrom, sale, limit, generation, variant, variants (one
-- line each of one string, see `reply`), '' where
-- there is nothing to say: seq numbers the change the call made, epoch is the
-- gate's, expiredSeq / expiredFrom tell of a hold the call expired on the way (the
-- caller records it), sale is the sale the change belongs to (the caller's config
-- may be older), limit / generation are the config's as the call read it, and
-- variant is the reservation's ('' for a drop without variants), variants the
-- config's variants as the call read them (reserve reads them). With a variant,
-- remaining is the variant's.

-- One call's keys and arguments, read by `begin` (a batch of reserves or
-- activations runs the same script body once per request, see batch.lua).
local K, KEY, LEDGER, SALE, GATE, EPOCH, CLOSED_AT, OWNER
local SEQ, EXPIRED, EXPIRED_FROM = '', '', ''
local LIMIT, GENERATION, VARIANTS = '', '', ''

-- What every request of one script run reads alike: the config's sale, the gate
-- and the sale's ledger (no script a batch runs, reserve or activate, writes them),
-- Redis's clock (one instant per run, as within any script) and the expiry set on
-- the drop's shared keys.
local SHARED, NOW, EXPIRES_SHARED = nil, nil, nil
-- The config's fields reserve reads (nothing a batch runs writes the config).
local RESERVE_CONFIG = nil
-- What a script that changes no count (activate) reads of remaining, once per run
-- for the drop and for each variant (see `remaining_read_once`).
local REMAINING_READ = {}
-- In a batch (batch.lua sets DEFERRING), what its requests add to or take out of
-- the drop's holds, unresolved and by-buyer sets is written once at the end of the
-- run, one ZREM and one ZADD a set (`flush_deferred`): nothing a batch runs reads
-- those sets meanwhile. Each member's last change in the run is the one written,
-- as one write after the other would leave it. DEFERRED: set -> member -> score
-- (false: taken out); DEFERRED_SETS: the sets with a deferred write; DEFERRED_BY:
-- the requests (by number, REQUEST) that deferred one. (One run, one batch: none
-- of these is reset.)
local DEFERRING = false
local DEFERRED, DEFERRED_SETS, DEFERRED_BY = {}, {}, {}
local REQUEST = 0
-- The time the run last set the shared keys to expire at (see `expire_shared`):
-- a set that a deferred write makes is set to expire then too.
local SHARED_EXPIRY = nil

local function begin(keys, argv)
  K = {
    config = keys[1], remaining = keys[2], held = keys[3], buyers = keys[4],
    holds = keys[5], marker = keys[6], gate = keys[7], seq = keys[8], ledger = keys[9],
    unresolved = keys[10], variants = keys[11], by_buyer = keys[12],
  }
  KEY, LEDGER = argv[1], argv[2]
  if not SHARED then
    SHARED = {
      -- The sale the config belongs to: a marker left by an earlier sale under the
      -- same name is nobody's reservation in this one.
      sale = redis.call('HGET', K.config, 'sale') or '',
      -- The gate key holds the epoch the gate is open at; 'closed:N' once it was
      -- closed for a move of the drop's authority to epoch N, or it is absent
      -- (never opened, or lost with the rest of Redis's data). While it is closed
      -- no new decision is made (see close.lua), and an opening at an epoch below
      -- N is refused: it began before that move, on a view of the ledger the move
      -- made stale (see open.lua).
      gate = redis.call('GET', K.gate) or '',
      -- The sale's one ledger: only its sidecars change the sale (see
      -- DropKeys::ledger).
      owner = redis.call('GET', K.ledger) or '',
    }
  end
  SALE, GATE, OWNER = SHARED.sale, SHARED.gate, SHARED.owner
  EPOCH, CLOSED_AT = GATE, 0
  if string.sub(GATE, 1, 7) == 'closed:' then
    EPOCH, CLOSED_AT = '', tonumber(string.sub(GATE, 8)) or 0
  end
  SEQ, EXPIRED, EXPIRED_FROM = '', '', ''
  LIMIT, GENERATION, VARIANTS = '', '', ''
end

-- Redis's own clock, so that every sidecar judges deadlines alike.
local function now_ms()
  if not NOW then
    local t = redis.call('TIME')
    NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return NOW
end

-- Sets the drop's shared keys to expire at `at` (once per run: every request of
-- a batch computes the same time).
local function expire_shared(at)
  SHARED_EXPIRY = at
  if EXPIRES_SHARED ~= at then
    for _, key in ipairs({K.held, K.buyers, K.holds, K.unresolved, K.seq, K.variants, K.by_buyer}) do
      redis.call('PEXPIREAT', key, at)
    end
    EXPIRES_SHARED = at
  end
end

-- Whether KEY has a marker in this sale.
local function ours()
  local sale = redis.call('HGET', K.marker, 'sale')
  return sale ~= false and sale == SALE
end

-- A marker that is still 'pending' is nobody's reservation yet: only the attempt
-- that admitted it may turn it into one (activate) or take it back (undo).
local function granted()
  return ours() and redis.call('HGET', K.marker, 'state') ~= 'pending'
end

-- Whether a confirm or cancel of KEY is prepared and not yet finished or aborted:
-- until it is, nothing else changes the reservation.
local function settling()
  return redis.call('HEXISTS', K.marker, 'settling') == 1
end

-- What the drop (or one of its variants) may still admit: a variant no more than
-- the drop as a whole (a cut or a removed variant's holds are paid back first).
local function remaining(variant)
  local drop = tonumber(redis.call('GET', K.remaining) or '0')
  if variant and variant ~= '' then
    return math.min(drop, tonumber(redis.call('HGET', K.variants, 'r:' .. variant) or '0'))
  end
  return drop
end

-- `remaining(variant)` as the run first read it: for a script that changes no
-- count, whose every request of a batch reads the same.
local function remaining_read_once(variant)
  local name = variant or ''
  if not REMAINING_READ[name] then
    REMAINING_READ[name] = remaining(variant)
  end
  return REMAINING_READ[name]
end

-- The variant KEY's marker holds ('' for a drop without variants).
local function marker_variant()
  return redis.call('HGET', K.marker, 'variant') or ''
end

-- An answer about no reservation in particular. Its fields go as one string, one
-- line each (no field can hold a line break: identifiers refuse control
-- characters): a batch's replies cost Redis one string each, not fifteen.
local function reply(outcome, user, quantity, state, when, left, variant)
  return outcome .. '\n' .. (user or '') .. '\n' .. (quantity or '') .. '\n' .. (state or '')
    .. '\n' .. (when or '') .. '\n' .. (left or '') .. '\n\n' .. EPOCH .. '\n\n\n' .. SALE
    .. '\n' .. LIMIT .. '\n' .. GENERATION .. '\n' .. (variant or '') .. '\n' .. VARIANTS
end

-- An answer that shows a reservation whose fields the caller holds (user,
-- quantity, state, expiresAt, variant as the marker has them) with `left` units
-- remaining: what `answer` reads, without reading it again.
local function shown(outcome, user, quantity, state, expires_at, variant, left)
  return outcome .. '\n' .. (user or '') .. '\n' .. (quantity or '') .. '\n' .. (state or '')
    .. '\n' .. (expires_at or '') .. '\n' .. tostring(left) .. '\n' .. tostring(SEQ)
    .. '\n' .. EPOCH .. '\n' .. tostring(EXPIRED) .. '\n' .. EXPIRED_FROM .. '\n' .. SALE
    .. '\n' .. LIMIT .. '\n' .. GENERATION .. '\n' .. (variant or '') .. '\n' .. VARIANTS
end

-- An answer that shows KEY's reservation.
local function answer(outcome)
  if not ours() then
    return reply(outcome, '', '', '', '', tostring(remaining()))
  end
  local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state', 'expiresAt', 'variant')
  return shown(outcome, m[1], m[2], m[3], m[4], m[5], remaining(m[5]))
end

-- Whether the caller's ledger is not the sale's: then it changes nothing here.
local function foreign()
  return OWNER ~= LEDGER
end

-- The refusal of a caller whose ledger is not the sale's (its state names the
-- sale's ledger, '' when the sale has none yet or its claim is not recorded yet).
local function refuse_foreign()
  if string.sub(OWNER, 1, 8) == 'claimed:' then
    return reply('foreign', '', '', '')
  end
  return reply('foreign', '', '', OWNER)
end

-- Whether a marker in `state` counts units in remaining and held.
local function holds_units(state)
  return state == 'active' or state == 'confirmed' or state == 'pending'
end

-- Takes units out of the drop's (and the variant's) stock into a hold.
local function take(user, quantity, variant)
  redis.call('DECRBY', K.remaining, quantity)
  redis.call('INCRBY', K.held, quantity)
  redis.call('HINCRBY', K.buyers, user, quantity)
  if variant ~= '' then
    redis.call('HINCRBY', K.variants, 'r:' .. variant, -quantity)
    redis.call('HINCRBY', K.variants, 'h:' .. variant, quantity)
  end
end

-- Returns a reservation's units: to stock (paying a deficit back first, since
-- remaining may be negative after a cut), out of the held count and the buyer's;
-- the same for its variant.
local function give_back(user, quantity, variant)
  -- The buyers' hash may be emptied, so deleted: a later admission of this run
  -- sets the expiry on its new one again.
  EXPIRES_SHARED = nil
  redis.call('INCRBY', K.remaining, quantity)
  redis.call('DECRBY', K.held, quantity)
  if redis.call('HINCRBY', K.buyers, user, -quantity) <= 0 then
    redis.call('HDEL', K.buyers, user)
  end
  if variant ~= '' then
    redis.call('HINCRBY', K.variants, 'r:' .. variant, quantity)
    redis.call('HINCRBY', K.variants, 'h:' .. variant, -quantity)
  end
end

-- Writes to the drop's sorted sets, deferred in a batch (see DEFERRING): adds
-- `member` to `set` with `score`, takes it out, or (ZADD XX) moves its score if it
-- is in the set. Every write of the gate scripts' shared code to the holds,
-- unresolved and by-buyer sets goes through these, so that no write made at once
-- in a batch is overwritten by a deferred one (the waitlist's lines are written at
-- once, and so do the scripts never batched, such as replay.lua).
local function deferred(set)
  local members = DEFERRED[set]
  if not members then
    members = {}
    DEFERRED[set] = members
    DEFERRED_SETS[#DEFERRED_SETS + 1] = set
  end
  DEFERRED_BY[REQUEST] = true
  return members
end
local function zadd(set, score, member)
  if DEFERRING then
    deferred(set)[member] = score
  else
    redis.call('ZADD', set, score, member)
  end
end
local function zrem(set, member)
  if DEFERRING then
    deferred(set)[member] = false
  else
    redis.call('ZREM', set, member)
  end
end
-- ZADD XX: a new score only for a member already listed (deferred or not).
local function zmove(set, score, member)
  local pending = DEFERRING and DEFERRED[set] and DEFERRED[set][member]
  if pending == nil or not DEFERRING then
    -- (No write of it waits: the set in Redis is as the run left it.)
    redis.call('ZADD', set, 'XX', score, member)
  elseif pending then
    deferred(set)[member] = score
  end
end

-- Writes what the run deferred, one ZREM then one ZADD a set, the unresolved set
-- first (should a later write fail, the sweeper still finds every pending admission
-- there), the others in any order. A write that fails raises its error: batch.lua
-- then answers every request in DEFERRED_BY with it.
local function flush_deferred()
  table.sort(DEFERRED_SETS, function(a, b)
    return a == K.unresolved and b ~= K.unresolved
  end)
  for _, set in ipairs(DEFERRED_SETS) do
    local added, taken = {}, {}
    for member, score in pairs(DEFERRED[set]) do
      if score then
        added[#added + 1] = score
        added[#added + 1] = member
      else
        taken[#taken + 1] = member
      end
    end
    if #taken > 0 then
      redis.call('ZREM', set, unpack(taken))
    end
    if #added > 0 then
      redis.call('ZADD', set, unpack(added))
      if SHARED_EXPIRY then
        -- Made now, after the run set the drop's shared keys to expire.
        redis.call('PEXPIREAT', set, SHARED_EXPIRY)
      end
    end
  end
  DEFERRED, DEFERRED_SETS = {}, {}
end

-- The waitlist's keys (see DropKeys::waitlist_line and the rest), named from the
-- config key's prefix: an offer or a return touches entries no caller can name
-- before the script runs. They carry the drop's hash tag, so they sit in its slot.
local function wl_prefix()
  return string.sub(K.config, 1, -8) .. ':wl:'
end
local function wl_line(variant)
  return wl_prefix() .. 'line:' .. (variant or '')
end
local function wl_entry(key)
  return wl_prefix() .. 'entry:' .. key
end
local function wl_users()
  return wl_prefix() .. 'users'
end

-- Units `user` waits for in the drop's lines: they count toward the per-user limit.
local function waiting_units(user)
  return tonumber(redis.call('HGET', wl_users(), user) or '0')
end

-- Units of the drop's own count set aside for the heads of the lines of its
-- variants (VARIANTS) other than `variant` that joined before position `before`
-- (math.huge for a buyer in no line): each such waiting head's quantity, as far
-- as its own variant has it. Heads go by when they joined, across lines, so two
-- lines never wait for each other. It binds only while a variant's debt (a cut
-- below what it holds) is in the drop's count; see reserve.lua.
local function set_aside(variant, before)
  local aside = 0
  for name in string.gmatch(VARIANTS, '([^,=]+)=[^,]*') do
    if name ~= variant then
      local head = redis.call('ZRANGE', wl_line(name), 0, 0)[1]
      if head then
        local e = redis.call('HMGET', wl_entry(head), 'state', 'quantity', 'sale', 'position')
        if e[1] == 'waiting' and e[3] == SALE and (tonumber(e[4]) or 0) < before then
          local own = tonumber(redis.call('HGET', K.variants, 'r:' .. name) or '0')
          aside = aside + math.max(0, math.min(own, tonumber(e[2]) or 0))
        end
      end
    end
  end
  return aside
end

-- Puts an entry whose offer was taken back (its admission undone, abandoned or
-- expired before it was durable) back at its place in its line, its units counted
-- as waiting again: nobody behind it is served first.
local function back_in_line(key)
  local e = redis.call('HMGET', wl_entry(key), 'state', 'user', 'quantity', 'variant', 'position')
  if e[1] ~= 'offering' then
    return
  end
  redis.call('HSET', wl_entry(key), 'state', 'waiting')
  redis.call('ZADD', wl_line(e[4]), e[5], key)
  redis.call('HINCRBY', wl_users(), e[2], e[3])
end

-- Takes a pending admission back as if it never happened: its units, its place in
-- the queues, the marker itself (so that a retry of the key can be admitted). An
-- offer to the waitlist's head goes back to its place in line.
local function take_back(user, quantity)
  EXPIRES_SHARED = nil
  zrem(K.holds, KEY)
  zrem(K.unresolved, KEY)
  give_back(user, quantity, marker_variant())
  if redis.call('HEXISTS', K.marker, 'line') == 1 then
    back_in_line(KEY)
  end
  redis.call('DEL', K.marker)
end

-- KEY's member of the by-buyer index (see DropKeys::by_buyer).
local function by_buyer_entry(user, at)
  return user .. '\n' .. string.format('%013d', at) .. '\n' .. KEY
end
-- Lists KEY's reservation under its buyer, admitted at `at` (ms): once it is one
-- (activated, or replayed from the ledger).
local function list_for_buyer(user, at)
  zadd(K.by_buyer, 0, by_buyer_entry(user, at))
end

-- Takes KEY's listing under `user` out (its marker names another reservation).
local function unlist_for_buyer(user, at)
  zrem(K.by_buyer, by_buyer_entry(user, at))
end

-- Ends a prepared confirm or cancel's bookkeeping (finished, aborted or replayed).
local function clear_settling()
  EXPIRES_SHARED = nil
  redis.call('HDEL', K.marker, 'settling', 'settleAttempt', 'settleBy', 'settleSeq',
    'settleQuantity', 'settleExpiresAt')
  zrem(K.unresolved, KEY)
end

-- What a call on an existing reservation (look-up, confirm, cancel, extension) is
-- answered before it looks at it: a closed gate; a caller whose ledger is not the
-- sale's; an admission not answered yet (whether it stands is decided within its
-- bound); no reservation of this sale; a change of it prepared and not yet finished
-- (ask again). nil: go on.
local function before_existing()
  if EPOCH == '' then
    return reply('closed')
  end
  if foreign() then
    return refuse_foreign()
  end
  if ours() and redis.call('HGET', K.marker, 'state') == 'pending' then
    return answer('pending')
  end
  if not granted() then
    return reply('not_found')
  end
  if settling() then
    return answer('settling')
  end
  return nil
end

-- A hold past its deadline flips to expired and returns its units, in the same
-- step: a reservation never reads as expired while its unit is still missing from
-- remaining. A 'pending' one (admitted, waiting for its throttle permit) expires
-- too, so a sidecar that died mid-admission cannot keep units forever. One whose
-- confirm or cancel is being recorded waits for it. Returns true when it expired the
-- hold now; the caller records the expiry in the ledger.
--
-- A pending admission expired here (its resolution could not reach the ledger
-- within the hold) may never have been made durable: its marker is 'unsure', listed
-- in the unresolved set scored by its `overdueAt`, and no retry hears of it as a
-- reservation (`already_reserved`) until it is resolved from the ledger: its row
-- makes it sure (activate.lua, or a replay of the row), a claim of the key deletes
-- the marker (undo.lua); nothing is given back twice.
local function expire_if_due(now)
  if not ours() or settling() then
    return false
  end
  local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state', 'expiresAt', 'overdueAt')
  if (m[3] == 'active' or m[3] == 'pending') and tonumber(m[4]) <= now then
    redis.call('HSET', K.marker, 'state', 'expired')
    zrem(K.holds, KEY)
    give_back(m[1], tonumber(m[2]), marker_variant())
    local offer = redis.call('HEXISTS', K.marker, 'line') == 1
    if m[3] == 'pending' and not offer then
      -- (XX: the entry moves, and a set lost meanwhile is not made again without
      -- the drop's expiry.)
      redis.call('HSET', K.marker, 'unsure', '1')
      zmove(K.unresolved, tonumber(m[5]) or now, KEY)
    else
      zrem(K.unresolved, KEY)
    end
    if m[3] == 'pending' and offer then
      -- An offer never made durable: the entry waits at its place again.
      back_in_line(KEY)
    end
    EXPIRED, EXPIRED_FROM = redis.call('INCR', K.seq), m[3]
    redis.call('HSET', K.marker, 'seq', EXPIRED)
    return true
  end
  return false
end

-- Prepares a confirm or cancel of KEY (`target`): the change is numbered and waits
-- for the ledger; until `finish` or `abort` (by `attempt`, or whoever resolves it
-- once it is overdue at `by`) nothing else changes the reservation, and an abort
-- leaves it exactly as it was.
local function prepare(target, attempt, by)
  SEQ = redis.call('INCR', K.seq)
  redis.call('HSET', K.marker, 'settling', target, 'settleAttempt', attempt, 'settleBy', by,
    'settleSeq', SEQ)
  zadd(K.unresolved, by, KEY)
end
