-- Shared by every gate script (concatenated in front of each at compile time).
--
-- Every script takes the same keys, all in the drop's one hash slot:
--   KEYS[1] config   KEYS[2] remaining   KEYS[3] held   KEYS[4] buyers
--   KEYS[5] holds    KEYS[6] the reservation marker
-- and ARGV[1], the idempotency key.
--
-- Every script answers {outcome, user, quantity, state, expiresAt, remaining}, as
-- strings, '' where there is nothing to say.
local K = {
  config = KEYS[1], remaining = KEYS[2], held = KEYS[3],
  buyers = KEYS[4], holds = KEYS[5], marker = KEYS[6],
}
local KEY = ARGV[1]

-- Redis's own clock, so that every sidecar judges deadlines alike.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A marker that is still 'pending' is nobody's reservation yet: only the attempt
-- that admitted it may turn it into one (activate) or take it back (undo).
local function granted()
  local state = redis.call('HGET', K.marker, 'state')
  return state and state ~= 'pending'
end

local function remaining()
  return tonumber(redis.call('GET', K.remaining) or '0')
end

local function answer(outcome)
  local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state', 'expiresAt')
  return {outcome, m[1] or '', m[2] or '', m[3] or '', m[4] or '', tostring(remaining())}
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

-- A hold past its deadline flips to expired and returns its units, in the same
-- step: a reservation never reads as expired while its unit is still missing from
-- remaining. A 'pending' one (admitted, waiting for its throttle permit) expires
-- too, so a sidecar that died mid-admission cannot keep units forever. Returns true
-- when it expired the hold now.
local function expire_if_due(now)
  local m = redis.call('HMGET', K.marker, 'user', 'quantity', 'state', 'expiresAt')
  if (m[3] == 'active' or m[3] == 'pending') and tonumber(m[4]) <= now then
    redis.call('HSET', K.marker, 'state', 'expired')
    redis.call('ZREM', K.holds, KEY)
    give_back(m[1], tonumber(m[2]))
    return true
  end
  return false
end
