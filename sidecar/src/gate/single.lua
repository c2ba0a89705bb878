-- The driver of a single call: the script's body (`one`) once, then the counters it
-- moved written back (see write_counts in prelude.lua), also when the body failed
-- part-way: what it changed before it failed stays, as for any script.
local ok, answered = pcall(one, KEYS, ARGV)
write_counts()
if ok then
  return answered
end
-- A command's error reply ({err = ...}) is answered as it is.
if type(answered) == 'table' then
  return answered
end
error(answered, 0)
