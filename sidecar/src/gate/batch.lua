-- The driver of a batch: several requests of one script (reserve or activate) for
-- one drop, decided one after the other in the order given, in one atomic step.
-- `one` is that script's body, exactly as a single call runs it (see mod.rs).
--
-- KEYS: the drop's eleven shared keys in the single call's order without the
-- marker (config, remaining, held, buyers, holds, gate, seq, ledger, unresolved,
-- variants, by buyer), then one marker per request. ARGV: each request's arguments as a
-- single call takes them (idempotency key, ledger, then the script's own), all of
-- the same width, then the batch's groups: the requests in order, as runs of a
-- letter and a count ('o3 a2 o1 v3'). Answers one reply per request, in order (a
-- failed one as '!' and its error).
--
-- 'o': each request on its own, as a call of its own would be decided. 'a' and 'v':
-- the lines of one cart on this drop, in mode 'all' and 'available'; no request of
-- another buyer comes between them. In mode 'all' a line that cannot be held (a
-- refusal: sold out, the per-user limit, the window, a pause, a variant or a key
-- that does not fit) means none of the cart's lines on this drop may be: every line
-- of the group admitted by this call is taken back (take_back: its units, its
-- queues and its marker, as undo does) and answered 'withdrawn'. Lines that were
-- already held before this call (a retry of the cart) and lines another attempt
-- still has pending stay as they are: the cart gives those back itself. Every line
-- is decided even after one was refused, so that the answer can name each line
-- that did not fit.
--
-- What the requests add to or take out of the drop's holds, unresolved and
-- by-buyer sets is written once at the end, one command a set (DEFERRING in
-- prelude.lua). Should one of those writes fail, every request that deferred a
-- write is answered that error (even one whose own sets were written), as a failed
-- step of its own would be: its other changes stay, and a pending admission among
-- them is settled within its bound (the unresolved set is written first).
local n = #KEYS - 11
-- (Checked to be whole below, before any request is decided.)
local width = (#ARGV - 1) / n
local replies = {}
local function keys_of(i)
  return {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[11 + i], KEYS[6], KEYS[7],
    KEYS[8], KEYS[9], KEYS[10], KEYS[11]}
end
local function argv_of(i)
  local argv = {}
  for j = 1, width do
    argv[j] = ARGV[(i - 1) * width + j]
  end
  return argv
end
local function outcome_of(text)
  return string.sub(text, 1, (string.find(text, '\n', 1, true) or 0) - 1)
end
local holding = {admitted = true, already_reserved = true, pending = true, overdue = true,
  settling = true}
-- The groups must name every request once before any is decided: a malformed
-- batch (only the sidecar's own code could send one) is refused with nothing done.
local named = 0
for mode, count in string.gmatch(ARGV[#ARGV], '(%a)(%d+)') do
  if mode ~= 'o' and mode ~= 'a' and mode ~= 'v' then
    return redis.error_reply('a batch with a group of unknown mode ' .. mode)
  end
  named = named + tonumber(count)
end
if n < 1 or named ~= n or (#ARGV - 1) % n ~= 0 then
  return redis.error_reply('a batch whose groups name ' .. named .. ' of its ' .. n
    .. ' requests, with ' .. (#ARGV - 1) .. ' arguments')
end
DEFERRING = true
local i = 0
for mode, count in string.gmatch(ARGV[#ARGV], '(%a)(%d+)') do
  local admitted = {}
  local refused = false
  for _ = 1, tonumber(count) do
    i = i + 1
    REQUEST = i
    -- A request whose step fails is answered with its error ('!' and the message),
    -- as a call of its own would be, and the others go on: one bad request never
    -- fails the batch (what it changed before it failed stays, as for a single call).
    local ok, answered = pcall(one, keys_of(i), argv_of(i))
    if ok then
      replies[i] = answered
      if mode ~= 'o' then
        local word = outcome_of(answered)
        if word == 'admitted' then
          admitted[#admitted + 1] = i
        elseif not holding[word] then
          refused = true
        end
      end
    elseif type(answered) == 'table' then
      replies[i] = '!' .. tostring(answered.err)
    else
      replies[i] = '!' .. tostring(answered)
    end
  end
  -- A take-back that fails answers its line's error, as a failed step does: the
  -- other groups' answers stand.
  if mode == 'a' and refused then
    for _, j in ipairs(admitted) do
      REQUEST = j
      local ok, failed = pcall(function()
        local argv = argv_of(j)
        begin(keys_of(j), argv)
        take_back(argv[3], tonumber(argv[4]))
        replies[j] = reply('withdrawn')
      end)
      if not ok then
        replies[j] = '!' .. tostring(type(failed) == 'table' and failed.err or failed)
      end
    end
  end
end
local flushed, why = pcall(flush_deferred)
if not flushed then
  local failed = '!' .. tostring(type(why) == 'table' and why.err or why)
  for j in pairs(DEFERRED_BY) do
    replies[j] = failed
  end
end
return replies
