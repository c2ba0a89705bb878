-- look: KEY's entry as it stands, with its place in line.
local early = wl_before()
if early then
  return early
end
return entry_reply('found')
