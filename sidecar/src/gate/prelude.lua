-- Shared by every gate script (concatenated in front of each at compile time).
--
-- Every script takes the same keys, all in the drop's one hash slot:
--   KEYS[1] config   KEYS[2] remaining   KEYS[3] held   KEYS[4] buyers
--   KEYS[5] holds    KEYS[6] the reservation marker     KEYS[7] gate (its epoch)
--   KEYS[8] seq      KEYS[9] the sale's ledger          KEYS[10] unresolved changes
--   KEYS[11] the variants' stock
-- and ARGV[1], the idempotency key, and ARGV[2], the id of the caller's ledger.
--
-- Every script answers {outcome, user, quantity, state, expiresAt, remaining, seq,
-- epoch, expiredSeq, expiredFrom, sale, limit, generation, variant, variants} as strings, '' where
-- there is nothing to say: seq numbers the change the call made, epoch is the
-- gate's, expiredSeq / expiredFrom tell of a hold the call expired on the way (the
-- caller records it), sale is the sale the change belongs to (the caller's config
-- may be older), limit / generation are the config's as the call read it, and
-- variant is the reservation's ('' for a drop without variants), variants the
-- config's variants as the call read them (reserve reads them). With a variant,
-- remaining is the variant's.
local K = {
  config = KEYS[1], remaining = KEYS[2], held = KEYS[3], buyers = KEYS[4],
  holds = KEYS[5], marker = KEYS[6], gate = KEYS[7], seq = KEYS[8], ledger = KEYS[9],
  unresolved = KEYS[10], variants = KEYS[11],
}
local KEY, LEDGER = ARGV[1], ARGV[2]
-- The sale the config belongs to: a marker left by an earlier sale under the same
-- name is nobody's reservation in this one.
local SALE = redis.call('HGET', K.config, 'sale') or ''
-- The gate key holds the epoch the gate is open at; 'closed:N' once it was closed
-- for a move of the drop's authority to epoch N, or it is absent (never opened, or
-- lost with the rest of Redis's data). While it is closed no new decision is made
-- (see close.lua), and an
-- opening at an epoch below N is refused: it began before that move, on a view of
-- the ledger the move made stale (see open.lua).
local GATE = redis.call('GET', K.gate) or ''
local EPOCH, CLOSED_AT = GATE, 0
if string.sub(GATE, 1, 7) == 'closed:' then
  EPOCH, CLOSED_AT = '', tonumber(string.sub(GATE, 8)) or 0
end
-- The sale's one ledger: only its sidecars change the sale (see DropKeys::ledger).
local OWNER = redis.call('GET', K.ledger) or ''
local SEQ = ''
local EXPIRED, EXPIRED_FROM = '', ''
local LIMIT, GENERATION, VARIANTS = '', '', ''

-- Redis's own clock, so that every sidecar judges deadlines alike.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Numbers a change the ledger will record. The counter only grows; a Redis that
-- lost writes hands out numbers the ledger already holds, which gives it away.
local function bump()
  SEQ = redis.call('INCR', K.seq)
  redis.call('HSET', K.marker, 'seq', SEQ)
  return SEQ
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

-- The variant KEY's marker holds ('' for a drop without variants).
local function marker_variant()
  return redis.call('HGET', K.marker, 'variant') or ''
end

-- An answer about no reservation in particular.
local function reply(outcome, user, quantity, state, when, left, variant)
  return {outcome, user or '', quantity or '', state or '', when or '', left or '',
    '', EPOCH, '', '', SALE, LIMIT, GENERATION, variant or '', VARIANTS}
end

-- An answer that shows KEY's reservation.
local function answer(outcome)
  if not ours() then
    return reply(outcome, '', '', '', '', tostring(remaining()))
  end
  local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state', 'expiresAt', 'variant')
  return {outcome, m[1] or '', m[2] or '', m[3] or '', m[4] or '', tostring(remaining(m[5])),
    tostring(SEQ), EPOCH, tostring(EXPIRED), EXPIRED_FROM, SALE, LIMIT, GENERATION, m[5] or '',
    VARIANTS}
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

-- Takes a pending admission back as if it never happened: its units, its place in
-- the queues, the marker itself (so that a retry of the key can be admitted).
local function take_back(user, quantity)
  redis.call('ZREM', K.holds, KEY)
  redis.call('ZREM', K.unresolved, KEY)
  give_back(user, quantity, marker_variant())
  redis.call('DEL', K.marker)
end

-- Ends a prepared confirm or cancel's bookkeeping (finished, aborted or replayed).
local function clear_settling()
  redis.call('HDEL', K.marker, 'settling', 'settleAttempt', 'settleBy', 'settleSeq')
  redis.call('ZREM', K.unresolved, KEY)
end

-- A hold past its deadline flips to expired and returns its units, in the same
-- step: a reservation never reads as expired while its unit is still missing from
-- remaining. A 'pending' one (admitted, waiting for its throttle permit) expires
-- too, so a sidecar that died mid-admission cannot keep units forever. One whose
-- confirm or cancel is being recorded waits for it. Returns true when it expired the
-- hold now; the caller records the expiry in the ledger.
local function expire_if_due(now)
  if not ours() or settling() then
    return false
  end
  local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state', 'expiresAt')
  if (m[3] == 'active' or m[3] == 'pending') and tonumber(m[4]) <= now then
    redis.call('HSET', K.marker, 'state', 'expired')
    redis.call('ZREM', K.holds, KEY)
    redis.call('ZREM', K.unresolved, KEY)
    give_back(m[1], tonumber(m[2]), marker_variant())
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
  redis.call('ZADD', K.unresolved, by, KEY)
end
