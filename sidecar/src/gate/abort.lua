-- abort: ARGV[3] the attempt that prepared a confirm or cancel the ledger did not
-- record (it refused or failed, or the attempt was judged dead and fenced off):
-- the preparation is undone and the reservation is as it was.
local m = redis.call('HMGET', K.marker, 'settleAttempt')
if not ours() or m[1] ~= ARGV[3] then
  return answer('gone')
end
clear_settling()
return answer('aborted')
