-- Shared by the waitlist's scripts (after prelude.lua).
--
-- An entry (DropKeys::waitlist_entry) is a hash: user, quantity, variant, state,
-- position (its score in its line), attempt (the join's), sale, overdueAt (while
-- joining). Its states, in the only order they move in:
--   joining   in line, its join not yet durable in the ledger: nobody is offered
--             past it; its join's sidecar makes it waiting or takes it out, or,
--             once overdue, whoever meets it resolves it from the ledger
--   waiting   in line, its units counted for the buyer (DropKeys::waitlist_users)
--   offering  out of line: an admission of its units under its key is pending
--             (reserve.lua with the offer flag); undone, it is waiting again at
--             its place (back_in_line)
--   offered   served: its key holds the reservation
--   left      the buyer left the line (or could no longer be served)
--
-- Every waitlist script answers outcome, user, quantity, state, place (1-based,
-- while in line), variant, detail, sale, position, attempt: one line each.

local function wl_reply(outcome, user, quantity, state, place, variant, detail, position, attempt)
  return outcome .. '\n' .. (user or '') .. '\n' .. (quantity or '') .. '\n' .. (state or '')
    .. '\n' .. (place or '') .. '\n' .. (variant or '') .. '\n' .. (detail or '') .. '\n' .. SALE
    .. '\n' .. (position or '') .. '\n' .. (attempt or '')
end

-- KEY's entry in this sale as it stands, with its place while it is in line (and
-- `detail`, for a join the config generation it was decided on).
local function entry_reply(outcome, detail)
  local e = redis.call('HMGET', wl_entry(KEY), 'user', 'quantity', 'state', 'variant', 'position',
    'attempt', 'sale')
  if not e[3] or e[7] ~= SALE then
    return wl_reply('none')
  end
  local place = ''
  if e[3] == 'waiting' or e[3] == 'joining' then
    local rank = redis.call('ZRANK', wl_line(e[4]), KEY)
    if rank then
      place = tostring(rank + 1)
    end
  end
  return wl_reply(outcome, e[1], e[2], e[3], place, e[4], detail, e[5], e[6])
end

-- What every waitlist call is answered before it looks at an entry: a closed gate,
-- a caller whose ledger is not the sale's. nil: go on.
local function wl_before()
  if EPOCH == '' then
    return wl_reply('closed')
  end
  if foreign() then
    if string.sub(OWNER, 1, 8) == 'claimed:' then
      return wl_reply('foreign')
    end
    return wl_reply('foreign', '', '', '', '', '', OWNER)
  end
  return nil
end

-- Takes KEY's entry out of its line (joining or waiting), its waiting units with it.
local function out_of_line(e)
  redis.call('ZREM', wl_line(e.variant), KEY)
  if redis.call('HINCRBY', wl_users(), e.user, -e.quantity) <= 0 then
    redis.call('HDEL', wl_users(), e.user)
  end
end

-- KEY's entry of this sale, or nil.
local function entry()
  local e = redis.call('HMGET', wl_entry(KEY), 'state', 'user', 'quantity', 'variant', 'position',
    'attempt', 'sale', 'overdueAt')
  if not e[1] or e[7] ~= SALE then
    return nil
  end
  return {state = e[1], user = e[2], quantity = tonumber(e[3]), variant = e[4] or '',
    position = tonumber(e[5]), attempt = e[6] or '', overdue_at = tonumber(e[8] or '0')}
end
