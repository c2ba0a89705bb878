-- Publishes a run of one drop's events, in order: KEYS[1] the drop's event stream,
-- ARGV the events as (event id, payload) pairs. Stops at the first event that cannot
-- be added, so that the drop's later events never go out before it. Answers how
-- many were added and, when one could not be, why ('' otherwise).
local added = 0
for i = 1, #ARGV - 1, 2 do
  local ok, failed = pcall(redis.call, 'XADD', KEYS[1], '*', 'eventId', ARGV[i], 'payload',
    ARGV[i + 1])
  if not ok then
    return {added, tostring(type(failed) == 'table' and failed.err or failed)}
  end
  added = added + 1
end
return {added, ''}
