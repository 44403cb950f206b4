-- sliding_counter.lua — approximate sliding window (two fixed-window counters), all or nothing.
--
-- KEYS[i]   one hash per limit: w = index of the current fixed window (now // window),
--           c = weight counted in that window, p = weight counted in the window before.
--           Memory is O(1) per key whatever the limit.
-- then      the call's calendar-aligned limits' keys (calendar.lua), its concurrency
--           limits' keys (3 each) and its keys' settings hashes (see gate.lua)
-- ARGV[1]   token: names the call's slot of its concurrency limits (if any)
-- ARGV[2]   the numbers, packed as little-endian doubles, as in sliding_log.lua:
--   1       mode: 0 acquire now or deny; 2 peek (write nothing). Modes 1 and 3 act as 0
--           (reservations are log-only, see README); mode 4 releases concurrency slots;
--           mode 9 settles a cost (see sliding_log.lua);
--           modes 6 and 7 are gate.lua's
--   2, 3, 4 horizon, guard and hold, microseconds (unused here: fixed windows stay
--           aligned; gate.lua's mode 8 reads them)
--   5, 6, 7 nc, ns, na: how many concurrency limits, settings hashes and
--           calendar-aligned limits (calendar.lua)
--   5+3i, 6+3i, 7+3i   for KEYS[i]: limit (weight units), window (microseconds) and
--           this call's cost there (1 <= cost <= limit); then the same three of each
--           aligned limit, gate.lua's numbers and calendar.lua's boundaries
--
-- Reply: {status, remaining, retry_after, reset_after, denied_by, at}, integers, as
--   sliding_log.lua: status 0 denied, 1 allowed, 4 released; times in microseconds;
--   at = server time.
--
-- Estimate at time now, e microseconds into the current window of length W:
--     estimate(now) = p * (W - e) / W + c
-- A call fits when estimate + cost <= limit. retry_after solves that for the
-- earliest instant, assuming no other traffic meanwhile: later in this window if
-- c + cost fits (the p term shrinks linearly), else in the next window, where the
-- current count becomes the previous one.

local TTL_MARGIN_MS = 1000
local ENTRY_FLOOR = 1e13

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token = ARGV[1]
local mode, horizon, guard, hold, nc, ns, na = struct.unpack('<ddddddd', ARGV[2])
local n = #KEYS - na - 3 * nc - ns
local numbers = {struct.unpack('<' .. string.rep('d', 3 * n), ARGV[2], 57)}
local nlimits, cbase, sbase, coff = n + na, n + na, n + na + 3 * nc, 57 + 24 * (n + na)
local abase, aidx, aoff, boff = n, n, 57 + 24 * n, coff + 16 * nc
if mode == 1 or mode == 3 then mode = 0 end

--- @include "gate.lua"
--- @include "calendar.lua"

local function reply(status, remaining, retry_after, reset, denied_by, at)
  commit(status, at)
  cal_commit(status, at)
  local free = conc_free()
  if free ~= nil and free < remaining then remaining = free end
  if na > 0 then
    remaining, reset = cal_reply(remaining, reset)
    if remaining < 0 then remaining = 0 end
  end
  return {status, remaining, retry_after, reset, denied_by, at}
end

if mode == 4 then
  return reply(4, 0, 0, 0, 0, now)
end
if mode == 9 then
  -- settle (see sliding_log.lua): the counter keeps no entries, so the difference
  -- is counted in the current window, if the call was counted in it
  local was = {struct.unpack('<' .. string.rep('d', n + na), ARGV[2], boff + 48 * na)}
  local found, free = cal_settle(was), nil
  for i = 1, n do
    local limit, window = rated(i, numbers[3 * i - 2], numbers[3 * i - 1], numbers[3 * i])
    local h = redis.call('HMGET', KEYS[i], 'w', 'c')
    local c = 0
    if tonumber(h[1]) == math.floor(now / window) then
      c = math.max(tonumber(h[2]) + numbers[3 * i] - was[i], 0)
      redis.call('HSET', KEYS[i], 'c', c)
      found = found + 1
    end
    if free == nil or limit - c < free then free = limit - c end
  end
  return reply(found > 0 and 7 or 0, math.max(free or 0, 0), 0, 0, 0, now)
end

local wids, cur, prev, limits, windows, costs = {}, {}, {}, {}, {}, {}
local at, denied_by, remaining, reset = now, 0, nil, 0
for i = 1, n do
  local cost = numbers[3 * i]
  local limit, window = rated(i, numbers[3 * i - 2], numbers[3 * i - 1], cost)
  costs[i] = cost
  local wid = math.floor(now / window)
  local h = redis.call('HMGET', KEYS[i], 'w', 'c', 'p')
  local w0 = tonumber(h[1])
  local c, p = tonumber(h[2]) or 0, tonumber(h[3]) or 0
  if w0 == nil or w0 < wid - 1 then
    c, p = 0, 0
  elseif w0 == wid - 1 then
    c, p = 0, c
  end
  local start = wid * window
  local elapsed = now - start
  local estimate = p * (window - elapsed) / window + c
  if estimate + cost > limit then
    local fits
    if c + cost <= limit then
      -- p * (W - e) / W <= limit - c - cost  =>  e >= W * (1 - (limit - c - cost) / p)
      fits = start + math.ceil(window * (1 - (limit - c - cost) / p)) + 1
    else
      -- next window: c * (W - e) / W + cost <= limit
      local e = 0
      if c > limit - cost then
        e = math.ceil(window * (1 - (limit - cost) / c)) + 1
      end
      fits = start + window + e
    end
    if fits > at then
      at, denied_by = fits, i
    end
  end
  local free = math.floor(limit - estimate)
  if remaining == nil or free < remaining then remaining = free end
  wids[i], cur[i], prev[i], limits[i], windows[i] = wid, c, p, limit, window
end

if gate > at then at, denied_by = gate, gate_by end
if na > 0 then
  local s, by = cal_at(at)
  if s > at then at, denied_by = s, aidx + by end
end

if denied_by ~= 0 or mode == 2 then
  for i = 1, n do
    local r = 0
    if cur[i] > 0 then
      r = (wids[i] + 2) * windows[i] - now
    elseif prev[i] > 0 then
      r = (wids[i] + 1) * windows[i] - now
    end
    if r > reset then reset = r end
  end
  if remaining < 0 then remaining = 0 end
  if denied_by ~= 0 then
    return reply(0, remaining, at - now, reset, denied_by, now)
  end
  return reply(1, remaining, 0, reset, 0, now)
end

remaining = nil
for i = 1, n do
  local c = cur[i] + costs[i]
  redis.call('HSET', KEYS[i], 'w', wids[i], 'c', c, 'p', prev[i])
  redis.call('PEXPIRE', KEYS[i], math.ceil(2 * windows[i] / 1000) + TTL_MARGIN_MS)
  local r = (wids[i] + 2) * windows[i] - now
  if r > reset then reset = r end
  local elapsed = now - wids[i] * windows[i]
  local free = math.floor(limits[i] - (prev[i] * (windows[i] - elapsed) / windows[i] + c))
  if remaining == nil or free < remaining then remaining = free end
end
if remaining < 0 then remaining = 0 end
return reply(1, remaining, 0, reset, 0, now)
