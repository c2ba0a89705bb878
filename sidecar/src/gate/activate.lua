-- activate: the admission ARGV[3] got its throttle permit and is durable in the
-- ledger; its pending marker becomes an active reservation (one expired while
-- pending is no longer 'unsure'). Anything else is
-- reported as it is: `gone` with the marker as it stands (expired meanwhile, taken
-- for dead and admitted afresh by a retry, activated by a replay from the ledger,
-- or no marker at all).
local m = redis.call('HMGET', K.marker, 'attempt', 'state', 'sale', 'user', 'admittedAt', 'line',
  'quantity', 'expiresAt', 'variant')
if m[3] == false or m[3] ~= SALE then
  return reply('gone', '', '', '', '', tostring(remaining_read_once()))
end
if m[2] == 'pending' and m[1] == ARGV[3] then
  redis.call('HSET', K.marker, 'state', 'active')
  zrem(K.unresolved, KEY)
  list_for_buyer(m[4], tonumber(m[5]) or now_ms())
  if m[6] then
    redis.call('HSET', wl_entry(KEY), 'state', 'offered')
  end
  return shown('admitted', m[4], m[7], 'active', m[8], m[9], remaining_read_once(m[9]))
end
if m[2] == 'expired' and m[1] == ARGV[3] and redis.call('HGET', K.marker, 'unsure') == '1' then
  -- Expired while pending, and this attempt is in the ledger: a reservation that
  -- was made (and has ended), no longer in doubt. Its units went back at expiry.
  redis.call('HDEL', K.marker, 'unsure')
  zrem(K.unresolved, KEY)
end
return shown('gone', m[4], m[7], m[2], m[8], m[9], remaining_read_once(m[9]))
