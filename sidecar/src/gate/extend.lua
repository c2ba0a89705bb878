-- extend: ARGV[3] attempt id, ARGV[4] the settle bound (ms): the ledger's commit
-- deadline, ARGV[5] the deadline asked for (ms since the epoch).
--
-- Prepares the extension of an active hold ('extending'): its deadline moves only
-- once the ledger recorded the new one and finish.lua makes it take effect, so an
-- extension the ledger could not record changed nothing (abort.lua). A deadline at
-- or before the current one changes nothing and is answered 'extended' with the
-- current one (a retry is harmless); one past the drop's maxHoldSeconds counted from
-- the admission is refused ('extension_refused'). While it is prepared the hold does
-- not expire (nothing else changes a reservation whose change is prepared).
local early = before_existing()
if early then
  return early
end
local now = now_ms()
if expire_if_due(now) then
  return answer('expired')
end
local m = redis.call('HMGET', K.marker, 'state', 'expiresAt', 'admittedAt')
if m[1] ~= 'active' then
  return answer(m[1])
end
local asked, current = tonumber(ARGV[5]), tonumber(m[2])
if asked <= current then
  return answer('extended')
end
local c = redis.call('HMGET', K.config, 'holdSeconds', 'maxHoldSeconds', 'generation')
-- The config's generation in the reply: a sidecar that read a newer one there (a
-- failover lost it) aborts the preparation rather than extend on this one.
GENERATION = c[3] or ''
local hold = tonumber(c[1]) or 0
local max_hold = tonumber(c[2] or '') or hold
-- A marker written before admissions kept their time: its deadline minus the hold.
local admitted = tonumber(m[3] or '') or (current - hold * 1000)
if asked > admitted + max_hold * 1000 then
  return answer('extension_refused')
end
prepare('extended', ARGV[3], now + tonumber(ARGV[4]))
redis.call('HSET', K.marker, 'settleExpiresAt', asked)
return answer('extending')
