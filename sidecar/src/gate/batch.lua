-- The driver of a batch: several requests of one script (reserve or activate) for
-- one drop, decided one after the other in the order given, in one atomic step.
-- `one` is that script's body, exactly as a single call runs it (see mod.rs).
--
-- KEYS: the drop's eleven shared keys in the single call's order without the
-- marker (config, remaining, held, buyers, holds, gate, seq, ledger, unresolved,
-- variants, by buyer), then one marker per request. ARGV: each request's arguments as a
-- single call takes them (idempotency key, ledger, then the script's own), all of
-- the same width. Answers one reply per request, in order (a failed one as '!' and
-- its error).
local n = #KEYS - 11
local width = #ARGV / n
local replies = {}
for i = 1, n do
  local keys = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[11 + i], KEYS[6], KEYS[7],
    KEYS[8], KEYS[9], KEYS[10], KEYS[11]}
  local argv = {}
  for j = 1, width do
    argv[j] = ARGV[(i - 1) * width + j]
  end
  -- A request whose step fails is answered with its error ('!' and the message),
  -- as a call of its own would be, and the others go on: one bad request never
  -- fails the batch (what it changed before it failed stays, as for a single call).
  local ok, answered = pcall(one, keys, argv)
  if ok then
    replies[i] = answered
  elseif type(answered) == 'table' then
    replies[i] = '!' .. tostring(answered.err)
  else
    replies[i] = '!' .. tostring(answered)
  end
end
return replies
