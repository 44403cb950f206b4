-- lib/cal_keys.lua — fixed windows aligned to a calendar in a time zone
-- (Limit(align=...)): an aligned limit's key and what lib/calendar.lua (a decision) and
-- lib/cal_edit.lua (a release, a settle) share, functions of its state table `cal`,
-- which cal_open returns. Included inside their block.
--
-- The key, a sorted set: one entry per counted call, as the log's (member = token, then
-- "." .. weight when not 1; score = the instant it counts at: its grant, its start or
-- its reserved slot), and one meta member per window that holds any: "#" .. the
-- window's start (µs), score = the weight counted in it; "~" = minus the instant the
-- key's expiry was set to (both below ENTRY_FLOOR): one range read gives them all.
-- Boundaries: six per aligned limit (µs), worked out by the caller in the zone: the
-- start of the window before the one holding the caller's clock, of that one and of the
-- four after it. Window j (any integer) starts at b[j] for 1 <= j <= 6; past them,
-- windows follow every `window` µs.
--
-- A call fits at instant s when the weight counted in the window holding s plus its
-- cost is at most the limit, or when its own entry already counts in that window.

-- At most this many entries of past windows are removed per call (see the log's)
local CAL_PRUNE = 500

local function cal_start(cal, j)
  if j < 1 then return cal.b[1] - (1 - j) * cal.window end
  if j > 6 then return cal.b[6] + (j - 6) * cal.window end
  return cal.b[j]
end

local function cal_index(cal, s)
  if s >= cal.b[6] then return 6 + math.floor((s - cal.b[6]) / cal.window) end
  if s < cal.b[1] then return 1 - math.ceil((cal.b[1] - s) / cal.window) end
  for j = 5, 1, -1 do
    if s >= cal.b[j] then return j end
  end
end

local function cal_name(cal, j)
  return '#' .. string.format('%.0f', cal_start(cal, j))
end

local function cal_used(cal, j)
  return cal.counts[cal_name(cal, j)] or 0
end

-- The state of the aligned limit `spec` ({key, limit, window, cost, b}, lib/call.lua)
-- for the call `token`: its windows' weights, and, with `own`, the window the call's
-- own entry counts in. Ended windows are pruned when `write`.
local function cal_open(spec, token, now, write, own)
  local cal = {key = spec.key, limit = spec.limit, window = spec.window, cost = spec.cost,
    b = spec.b, counts = {}, expiry = 0,
    member = spec.cost == 1 and token or token .. '.' .. spec.cost}
  cal.cur = cal_index(cal, now)
  local first = cal_start(cal, cal.cur)
  local metas = redis.call('ZRANGEBYSCORE', cal.key, '-inf', '(' .. ENTRY_FLOOR, 'WITHSCORES')
  local past = {}
  for m = 1, #metas, 2 do
    local name = metas[m]
    if name == '~' then
      cal.expiry = -tonumber(metas[m + 1])
    elseif tonumber(string.sub(name, 2)) < first then
      past[#past + 1] = name
    else
      cal.counts[name] = tonumber(metas[m + 1])
    end
  end
  if #past > 0 and write then
    -- a window has ended: its entries go, a batch per call; its meta member once the
    -- last batch has gone (so that the next call knows to go on)
    local upto = '(' .. string.format('%.0f', first)
    local edge = redis.call('ZRANGEBYSCORE', cal.key, ENTRY_FLOOR, upto, 'WITHSCORES', 'LIMIT', CAL_PRUNE, 1)
    if edge[2] then
      redis.call('ZREMRANGEBYSCORE', cal.key, ENTRY_FLOOR, '(' .. edge[2])
    else
      redis.call('ZREMRANGEBYSCORE', cal.key, ENTRY_FLOOR, upto)
      redis.call('ZREM', cal.key, unpack(past))
    end
  end
  if own then
    local s = redis.call('ZSCORE', cal.key, cal.member)
    if s then cal.own, cal.own_at = cal_index(cal, tonumber(s)), tonumber(s) end
  end
  return cal
end

-- Add `weight` to the weight counted in window j (its meta member).
local function cal_add(cal, j, weight)
  local name = cal_name(cal, j)
  local used = cal_used(cal, j) + weight
  cal.counts[name] = used
  if used > 0 then
    redis.call('ZADD', cal.key, used, name)
  else
    redis.call('ZREM', cal.key, name)
  end
end

-- The weight still free in the current window, and µs until every window counted in
-- has ended.
local function cal_state(cal, now)
  local reset = 0
  for name, used in pairs(cal.counts) do
    if used > 0 then
      local r = cal_start(cal, cal_index(cal, tonumber(string.sub(name, 2))) + 1) - now
      if r > reset then reset = r end
    end
  end
  return cal.limit - cal_used(cal, cal.cur), reset
end
