-- lib/fit.lua — the first fit of a call in a sliding log (docs/timing.md, "Exact
-- windows"), in plain values for acquire.lua and lib/log_search.lua: the earliest s from
-- `from` at which no window (t - w, t], t in [s, s + w), holds more than `cap`. Only an
-- entry coming in makes a window heavier, so the windows to check end at s and at each
-- entry in (s, s + w); past a full one, the search goes on from where it has room. At
-- most FIT_STEPS windows, else `last`: the end of the line, from which every instant fits.

local FIT_STEPS = 4

-- nil if the window ending at p holds at most `cap`, else the instant it would. `unit`:
-- the weight of every entry (0: each member's, read by `weigh`).
local function fit_window(key, p, w, cap, unit, weigh)
  local lo, hi = string.format('(%.0f', p - w), string.format('%.0f', p)
  if unit > 0 then
    local held = redis.call('ZCOUNT', key, lo, hi) * unit
    if held <= cap then return nil end
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
      s, p = room, room  -- nothing in (p - w, room) fits
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
