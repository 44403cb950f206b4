-- lib/fit.lua — the first fit of a call in a sliding log (lib/log_search.lua,
-- log_fit_at; acquire.lua's own for a plain call): the earliest instant from `from` at
-- which the call fits every window of the log `key` that holds it, counting every
-- entry, when that comes before the end of the line. Plain values, so that the plain
-- acquire.lua, which builds no state table, places a call as the full script does.
--
-- The instant s fits when no window (t - W, t] with t in [s, s + W) holds more than
-- `cap` (the limit less the call's cost). A window's weight grows only where an entry
-- comes in, so the windows to check end at s and at each entry in (s, s + W). Where one
-- holds too much, no s before the instant enough of its weight has left fits: the
-- search goes on from there. It checks at most FIT_STEPS windows, then settles for
-- `last` (an instant from which every instant fits: the end of the line); a hole further
-- ahead is taken once it is nearer.

local FIT_STEPS = 4

-- nil if the window of `key` ending at p holds at most `cap`, else the instant from
-- which it would (in (p, p + w]). `unit`: the weight of every entry (0: mixed, each read
-- by `weigh` from its member).
local function fit_window(key, p, w, cap, unit, weigh)
  local lo, hi = string.format('(%.0f', p - w), string.format('%.0f', p)
  if unit > 0 then
    local held = redis.call('ZCOUNT', key, lo, hi) * unit
    if held <= cap then return nil end
    -- the entry whose leaving makes room
    local row = redis.call('ZRANGEBYSCORE', key, lo, hi, 'WITHSCORES', 'LIMIT',
      math.ceil((held - cap) / unit) - 1, 1)
    return tonumber(row[2]) + w
  end
  local rows = redis.call('ZRANGEBYSCORE', key, lo, hi, 'WITHSCORES')
  local held = 0
  for j = 1, #rows, 2 do held = held + weigh(rows[j]) end
  if held <= cap then return nil end
  for j = 1, #rows, 2 do
    held = held - weigh(rows[j])
    if held <= cap then return tonumber(rows[j + 1]) + w end
  end
end

local function fit_at(key, from, w, cap, unit, weigh, last)
  local s, p = from, from
  for _ = 1, FIT_STEPS do
    local room = fit_window(key, p, w, cap, unit, weigh)
    if room then
      -- no instant in (p - w, room) fits: s is one of them
      s, p = room, room
      if s >= last then return last end
    else
      local row = redis.call('ZRANGEBYSCORE', key, string.format('(%.0f', p),
        string.format('(%.0f', s + w), 'WITHSCORES', 'LIMIT', 0, 1)
      if not row[2] then return s end
      p = tonumber(row[2])
    end
  end
  return last
end
