-- Shared by every gate script (concatenated in front of each at compile time).
--
-- Every script takes the same keys, all in the drop's one hash slot:
--   KEYS[1] config   KEYS[2] remaining   KEYS[3] held   KEYS[4] buyers
--   KEYS[5] holds    KEYS[6] the reservation marker     KEYS[7] gate (its epoch)
--   KEYS[8] seq      KEYS[9] ledgers  KEYS[10] pending
-- and ARGV[1], the idempotency key.
--
-- Every script answers {outcome, user, quantity, state, expiresAt, remaining, seq,
-- epoch, expiredSeq, expiredFrom, sale} as strings, '' where there is nothing to
-- say: seq numbers the change the call made, epoch is the gate's, expiredSeq /
-- expiredFrom tell of a hold the call expired on the way (the caller records it),
-- and sale is the sale the change belongs to (the caller's config may be older).
local K = {
  config = KEYS[1], remaining = KEYS[2], held = KEYS[3], buyers = KEYS[4],
  holds = KEYS[5], marker = KEYS[6], gate = KEYS[7], seq = KEYS[8], ledgers = KEYS[9],
  pending = KEYS[10],
}
local KEY = ARGV[1]
-- The sale the config belongs to: a marker left by an earlier sale under the same
-- name is nobody's reservation in this one.
local SALE = redis.call('HGET', K.config, 'sale') or ''
-- Absent while the gate is closed (never opened, being rebuilt, or lost with the
-- rest of Redis's data): nothing changes then. 'lost' is a tombstone: Redis lost a
-- sale whose record is spread over per-pod ledgers, and the gate stays closed.
local EPOCH = redis.call('GET', K.gate) or ''
local LOST = EPOCH == 'lost'
if LOST then
  EPOCH = ''
end
local SEQ = ''
local EXPIRED, EXPIRED_FROM = '', ''

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

local function remaining()
  return tonumber(redis.call('GET', K.remaining) or '0')
end

-- An answer about no reservation in particular.
local function reply(outcome, user, quantity, state, when, left)
  return {outcome, user or '', quantity or '', state or '', when or '', left or '',
    '', EPOCH, '', '', SALE}
end

-- An answer that shows KEY's reservation.
local function answer(outcome)
  if not ours() then
    return reply(outcome, '', '', '', '', tostring(remaining()))
  end
  local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state', 'expiresAt')
  return {outcome, m[1] or '', m[2] or '', m[3] or '', m[4] or '', tostring(remaining()),
    tostring(SEQ), EPOCH, tostring(EXPIRED), EXPIRED_FROM, SALE}
end

-- Returns a reservation's units: to stock (paying a deficit back first, since
-- remaining may be negative after a cut), out of the held count and the buyer's.
local function give_back(user, quantity)
  redis.call('INCRBY', K.remaining, quantity)
  redis.call('DECRBY', K.held, quantity)
  if redis.call('HINCRBY', K.buyers, user, -quantity) <= 0 then
    redis.call('HDEL', K.buyers, user)
  end
end

-- Takes a pending admission back as if it never happened: its units, its place in
-- the queues, the marker itself (so that a retry of the key can be admitted).
local function take_back(user, quantity)
  redis.call('ZREM', K.holds, KEY)
  redis.call('ZREM', K.pending, KEY)
  give_back(user, quantity)
  redis.call('DEL', K.marker)
end

-- A hold past its deadline flips to expired and returns its units, in the same
-- step: a reservation never reads as expired while its unit is still missing from
-- remaining. A 'pending' one (admitted, waiting for its throttle permit) expires
-- too, so a sidecar that died mid-admission cannot keep units forever. Returns true
-- when it expired the hold now; the caller records the expiry in the ledger.
local function expire_if_due(now)
  if not ours() then
    return false
  end
  local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state', 'expiresAt')
  if (m[3] == 'active' or m[3] == 'pending') and tonumber(m[4]) <= now then
    redis.call('HSET', K.marker, 'state', 'expired')
    redis.call('ZREM', K.holds, KEY)
    redis.call('ZREM', K.pending, KEY)
    give_back(m[1], tonumber(m[2]))
    EXPIRED, EXPIRED_FROM = redis.call('INCR', K.seq), m[3]
    redis.call('HSET', K.marker, 'seq', EXPIRED)
    return true
  end
  return false
end
