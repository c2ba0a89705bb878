-- The driver of a cart's lines on one drop: the reserve script's body (`one`, run
-- exactly as a single call runs it) for each line, in the order given, in one
-- atomic step, so that no other buyer's request comes between two lines of a cart.
--
-- KEYS: as batch.lua's (the drop's eleven shared keys, then one marker per line).
-- ARGV: each line's reserve arguments (idempotency key, ledger, then reserve's
-- own), all of the same width, then the cart's mode: 'all' or 'available'.
-- Answers one reply per line, in order (a failed one as '!' and its error).
--
-- In mode 'all' a line that cannot be held (a refusal: sold out, the per-user
-- limit, the window, a pause, a variant or a key that does not fit) means none of
-- the cart's lines on this drop may be: every line admitted by this call is taken
-- back (take_back: its units, its queues and its marker, as undo does) and answered
-- 'withdrawn'. Lines that were already held before this call (a retry of the cart)
-- and lines another attempt still has pending stay as they are: the cart gives
-- those back itself. Every line is decided even after one was refused, so that the
-- answer can name each line that did not fit.
local n = #KEYS - 11
local whole = ARGV[#ARGV] == 'all'
local width = (#ARGV - 1) / n
local replies = {}
local admitted = {}
local refused = false
local function outcome_of(text)
  return string.sub(text, 1, (string.find(text, '\n', 1, true) or 0) - 1)
end
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
local holding = {admitted = true, already_reserved = true, pending = true, overdue = true,
  settling = true}
for i = 1, n do
  local ok, answered = pcall(one, keys_of(i), argv_of(i))
  if ok then
    replies[i] = answered
    local word = outcome_of(answered)
    if word == 'admitted' then
      admitted[#admitted + 1] = i
    elseif not holding[word] then
      refused = true
    end
  elseif type(answered) == 'table' then
    replies[i] = '!' .. tostring(answered.err)
  else
    replies[i] = '!' .. tostring(answered)
  end
end
if whole and refused then
  for _, i in ipairs(admitted) do
    local argv = argv_of(i)
    begin(keys_of(i), argv)
    take_back(argv[3], tonumber(argv[4]))
    replies[i] = reply('withdrawn')
  end
end
return replies
