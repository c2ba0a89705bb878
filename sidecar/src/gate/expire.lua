-- expire (the sweeper): expires the hold if it is due; anything else is left alone.
if EPOCH == '' then
  return reply('closed')
end
if expire_if_due(now_ms()) then
  return answer('expired')
end
return answer('not_due')
