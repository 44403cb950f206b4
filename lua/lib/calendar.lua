-- lib/calendar.lua — fixed windows aligned to a calendar in a time zone
-- (Limit(align=...)). Functions of an aligned limit's state table `cal`, which
-- cal_open returns.
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
--
-- Included by an entry script only for a call that declares aligned limits: the file
-- defines one local, `calendar`, the table of the functions the bodies call (the rest
-- are local to its block).

local calendar
do

local CAL_KEEP_MS = 1000
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

local function cal_fits(cal, j)
  return cal.own == j or cal_used(cal, j) + cal.cost <= cal.limit
end

-- The earliest instant from s at which the call fits every aligned limit of `cals`,
-- and the index (among them) of the last one that moved it (0: none). Gives up (returns
-- the instant reached) past `horizon` from now.
local function cal_at(cals, s, now, horizon)
  local by, moved = 0, true
  while moved do
    moved = false
    for a, cal in ipairs(cals) do
      local j = cal_index(cal, s)
      while not cal_fits(cal, j) do
        j = j + 1
        s, by, moved = cal_start(cal, j), a, true
        if s - now > horizon then return s, by end
      end
    end
  end
  return s, by
end

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

-- Count the call at instant `at`, moving its entry from another window if it has one.
local function cal_count(cal, at, now)
  local j = cal_index(cal, at)
  local write = {at, cal.member}
  if cal.own ~= j then
    if cal.own and cal.own >= cal.cur then cal_add(cal, cal.own, -cal.cost) end
    local name = cal_name(cal, j)
    cal.counts[name] = cal_used(cal, j) + cal.cost
    write[3], write[4] = cal.counts[name], name
    cal.own = j
  end
  local till = cal_start(cal, j + 1) + CAL_KEEP_MS * 1000
  if till > cal.expiry then
    write[#write + 1], write[#write + 2] = -till, '~'
    redis.call('ZADD', cal.key, unpack(write))
    redis.call('PEXPIRE', cal.key, math.ceil((till - now) / 1000))
    cal.expiry = till
  else
    redis.call('ZADD', cal.key, unpack(write))
  end
end

-- Give back the call's entry if it still lies ahead (a release).
local function cal_release(cal, now)
  if cal.own and cal.own_at > now then
    if cal.own >= cal.cur then cal_add(cal, cal.own, -cal.cost) end
    redis.call('ZREM', cal.key, cal.member)
    cal.own = nil
  end
end

-- The call's entry, counted at weight `was`, now weighs its cost; its window's weight
-- follows if the window has not ended. True if the entry was found.
local function cal_settle(cal, was, token)
  local old = was == 1 and token or token .. '.' .. was
  local s = redis.call('ZSCORE', cal.key, old)
  if not s then return false end
  s = tonumber(s)
  redis.call('ZREM', cal.key, old)
  redis.call('ZADD', cal.key, s, cal.member)
  local j = cal_index(cal, s)
  if j >= cal.cur then cal_add(cal, j, cal.cost - was) end
  return true
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

-- The states of the call `c`'s aligned limits (lib/call.lua), as cal_open gives them.
local function cal_open_all(c, write, own)
  local cals = {}
  for j, spec in ipairs(c.cals) do cals[j] = cal_open(spec, c.token, c.now, write, own) end
  return cals
end

-- The earliest instant from `gate` (set by limit `by`, lib/call.lua's denied_by) at which
-- the call `c` fits its aligned limits `cals`, and the index of the limit that set it.
local function cal_gate(c, cals, gate, by)
  local s, a = cal_at(cals, gate, c.now, c.horizon)
  if s > gate then gate, by = s, #c.logs + a end
  return gate, by
end

-- Count the call in the window holding `at` when the answer `status` (lib/call.lua)
-- counts it: a start, or a reservation.
local function cal_commit(cals, status, at, now)
  if status == 1 or status == 2 or status == 3 or status == 6 then
    for _, cal in ipairs(cals) do cal_count(cal, at, now) end
  end
end

calendar = {open = cal_open, open_all = cal_open_all, gate = cal_gate, commit = cal_commit,
  release = cal_release, settle = cal_settle, state = cal_state}
end
