-- reserve: ARGV[2] user, ARGV[3] quantity, ARGV[4] attempt id, ARGV[5] ledger id,
-- ARGV[6] the pending bound (ms): how long an admission may stay pending before it
-- is overdue (its permit wait plus the ledger's commit).
--
-- In one atomic step: the mode and the gate, the idempotency marker, the sale
-- window, the per-user limit, the stock; then decrement, count the buyer, write the
-- marker. The marker starts 'pending': the sidecar still has to get a throttle
-- permit and make the admission durable, and then activates it (activate.lua) or
-- takes it back (undo.lua). A duplicate that finds it pending is told so and asks
-- again, so no one is promised a unit that is then undone.
local cfg = redis.call('HMGET', K.config,
  'mode', 'perUserLimit', 'startsAt', 'endsAt', 'holdSeconds', 'expireAt')
if not cfg[1] then
  return reply('not_found')
end
if cfg[1] ~= 'gate' then
  return reply('mode', '', '', cfg[1])
end
if EPOCH == '' then
  return reply('closed')
end
local user, quantity, attempt = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local now = now_ms()

if ours() then
  local owner = redis.call('HMGET', K.marker, 'user', 'quantity')
  if owner[1] == user and tonumber(owner[2]) == quantity then
    expire_if_due(now)
    if not granted() then
      if redis.call('HGET', K.marker, 'state') == 'pending'
        and tonumber(redis.call('HGET', K.marker, 'overdueAt')) <= now then
        -- Its sidecar never finished it (it died): this retry of the same buyer
        -- takes the admission over, with the unit it already holds.
        redis.call('HSET', K.marker, 'attempt', attempt, 'overdueAt', now + tonumber(ARGV[6]))
        redis.call('ZADD', K.pending, now + tonumber(ARGV[6]), KEY)
        return answer('admitted')
      end
      return answer('pending')
    end
    return answer('already_reserved')
  end
  return reply('idempotency_key_reused', '', '', '', '', tostring(remaining()))
end

if cfg[3] ~= '' and now < tonumber(cfg[3]) then
  return reply('not_open', '', '', '', cfg[3])
end
if cfg[4] ~= '' and now >= tonumber(cfg[4]) then
  return reply('ended', '', '', '', cfg[4])
end

local bought = tonumber(redis.call('HGET', K.buyers, user) or '0')
if bought + quantity > tonumber(cfg[2]) then
  return reply('per_user_limit_exceeded', user, tostring(bought), '', cfg[2],
    tostring(remaining()))
end

local left = remaining()
if left < quantity then
  return reply('sold_out', '', '', '', '', tostring(left))
end

local deadline = now + tonumber(cfg[5]) * 1000
redis.call('DECRBY', K.remaining, quantity)
redis.call('INCRBY', K.held, quantity)
redis.call('HINCRBY', K.buyers, user, quantity)
redis.call('ZADD', K.holds, deadline, KEY)
redis.call('DEL', K.marker)
redis.call('HSET', K.marker, 'user', user, 'quantity', quantity, 'state', 'pending',
  'expiresAt', deadline, 'attempt', attempt, 'sale', SALE,
  'overdueAt', now + tonumber(ARGV[6]), 'ledger', ARGV[5])
redis.call('ZADD', K.pending, now + tonumber(ARGV[6]), KEY)
bump()
redis.call('SADD', K.ledgers, ARGV[5])
-- The marker outlives the hold so that a late retry still reads already_reserved;
-- the drop's other keys expire with the config when the sale has an end.
if cfg[6] ~= '' then
  for _, key in ipairs({K.held, K.buyers, K.holds, K.pending, K.marker, K.seq, K.ledgers}) do
    redis.call('PEXPIREAT', key, cfg[6])
  end
else
  redis.call('PEXPIREAT', K.marker, deadline + 7 * 86400 * 1000)
end
return answer('admitted')
