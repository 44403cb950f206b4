-- lib/fit.lua — a call's first fit in a sliding log (docs/timing.md, "Exact windows"): the
-- earliest s from `from` at which no window ending in [s, s + w) holds more than `cap`,
-- checking those ending at s and at each entry after it; `last` after FIT_STEPS windows.

local FIT_STEPS = 4

-- nil if the window ending at p holds at most `cap` in entries of weight `unit`, else
-- the instant it would
local function counted_room(key, p, w, cap, unit)
  local lo, hi = string.format('(%.0f', p - w), string.format('%.0f', p)
  local held = redis.call('ZCOUNT', key, lo, hi) * unit
  if held <= cap then return nil end
  local row = redis.call('ZRANGEBYSCORE', key, lo, hi, 'WITHSCORES', 'LIMIT',
    math.ceil((held - cap) / unit) - 1, 1)
  return tonumber(row[2]) + w
end

-- `room`: counted_room, or one that weighs each entry (lib/log_search.lua)
local function fit_at(key, from, w, cap, unit, room, last)
  local s, p = from, from
  for _ = 1, FIT_STEPS do
    local r = room(key, p, w, cap, unit)
    if r then
      s, p = r, r  -- nothing in (p - w, r) fits
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
