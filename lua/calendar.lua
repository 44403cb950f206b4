-- calendar.lua — fixed windows aligned to a calendar in a time zone (Limit(align=...)).
-- Included by sliding_log.lua, sliding_counter.lua and concurrency.lua after gate.lua,
-- once they have set `na` (how many aligned limits), `abase` (KEYS index before the
-- first one's key), `aidx` (the call's limits before the first one), `aoff` (byte
-- offset in ARGV[2] of their (limit, window µs, cost)) and `boff` (of their boundaries).
--
-- KEYS[abase + a]  a sorted set per aligned limit: one entry per counted call, as the
--   log's (member = token, then "." .. weight when not 1; score = the instant it
--   counts at: its grant, its start or its reserved slot), and one meta member per
--   window that holds any: "#" .. the window's start (µs), score = the weight counted
--   in it, and "~" = minus the instant the key's expiry was set to (both below
--   ENTRY_FLOOR, like the log's meta members): one range read gives them all.
-- Boundaries: six per aligned limit (µs), worked out by the caller in the zone: the
--   start of the window before the one holding the caller's clock, of that one and of
--   the four after it. Window j (any integer) starts at b[j] for 1 <= j <= 6; past
--   them, windows follow every `window` µs (a caller's clock off by more than a few
--   windows still finds the windows of a minute or an hour exactly).
--
-- A call fits at instant s when the weight counted in the window holding s plus its
-- cost is at most the limit, or when its own entry already counts in that window (a
-- reservation confirmed in its window). `cal_at(s)` is the earliest instant from s at
-- which the call fits every aligned limit: s, or the start of a later window. The
-- gate is raised to cal_at(gate), so a call that fits its other limits waits for its
-- window; a later instant the other limits choose is checked again with cal_at.
-- `cal_commit` counts the call in the window of the instant it is given (moving its
-- entry from another window), or, on a release, removes an entry still in the future.

local CAL_KEEP_MS = 1000
-- At most this many entries of past windows are removed per call (see the log's)
local CAL_PRUNE = 500

local cal = {}

local function cal_start(c, j)
  if j < 1 then return c.b[1] - (1 - j) * c.window end
  if j > 6 then return c.b[6] + (j - 6) * c.window end
  return c.b[j]
end

local function cal_index(c, s)
  if s >= c.b[6] then return 6 + math.floor((s - c.b[6]) / c.window) end
  if s < c.b[1] then return 1 - math.ceil((c.b[1] - s) / c.window) end
  for j = 5, 1, -1 do
    if s >= c.b[j] then return j end
  end
end

local function cal_name(c, j)
  return '#' .. string.format('%.0f', cal_start(c, j))
end

local function cal_used(c, j)
  return c.counts[cal_name(c, j)] or 0
end

for a = 1, na do
  local limit, window, cost = struct.unpack('<ddd', ARGV[2], aoff + 24 * (a - 1))
  -- an override of the same window changes the limit; the windows stay the calendar's
  local l, w = rated(aidx + a, limit, window, cost)
  if w == window then limit = l end
  local c = {key = KEYS[abase + a], limit = limit, window = window, cost = cost,
    b = {struct.unpack('<dddddd', ARGV[2], boff + 48 * (a - 1))}, counts = {},
    member = cost == 1 and token or token .. '.' .. cost}
  c.cur = cal_index(c, now)
  local first = cal_start(c, c.cur)
  local metas = redis.call('ZRANGEBYSCORE', c.key, '-inf', '(' .. ENTRY_FLOOR, 'WITHSCORES')
  local past = {}
  c.expiry = 0
  for m = 1, #metas, 2 do
    local name = metas[m]
    if name == '~' then
      c.expiry = -tonumber(metas[m + 1])
    elseif tonumber(string.sub(name, 2)) < first then
      past[#past + 1] = name
    else
      c.counts[name] = tonumber(metas[m + 1])
    end
  end
  if #past > 0 and mode ~= 2 and mode <= 5 then
    -- a window has ended: its entries go, a batch per call; its meta member once the
    -- last batch has gone (so that the next call knows to go on)
    local upto = '(' .. string.format('%.0f', first)
    local edge = redis.call('ZRANGEBYSCORE', c.key, ENTRY_FLOOR, upto, 'WITHSCORES', 'LIMIT', CAL_PRUNE, 1)
    if edge[2] then
      redis.call('ZREMRANGEBYSCORE', c.key, ENTRY_FLOOR, '(' .. edge[2])
    else
      redis.call('ZREMRANGEBYSCORE', c.key, ENTRY_FLOOR, upto)
      redis.call('ZREM', c.key, unpack(past))
    end
  end
  if mode >= 3 then
    local own = redis.call('ZSCORE', c.key, c.member)
    if own then c.own, c.own_at = cal_index(c, tonumber(own)), tonumber(own) end
  end
  cal[a] = c
end

local function cal_fits(c, j)
  return c.own == j or cal_used(c, j) + c.cost <= c.limit
end

-- The earliest instant from s at which the call fits every aligned limit, and the
-- index (among them) of the last one that moved it (0: none). Gives up (returns the
-- instant reached) past `horizon` from now.
local function cal_at(s)
  local by, moved = 0, true
  while moved do
    moved = false
    for a = 1, na do
      local c = cal[a]
      local j = cal_index(c, s)
      while not cal_fits(c, j) do
        j = j + 1
        s, by, moved = cal_start(c, j), a, true
        if s - now > horizon then return s, by end
      end
    end
  end
  return s, by
end

local function cal_add(c, j, weight)
  local name = cal_name(c, j)
  local used = cal_used(c, j) + weight
  c.counts[name] = used
  if used > 0 then
    redis.call('ZADD', c.key, used, name)
  else
    redis.call('ZREM', c.key, name)
  end
end

-- Count the call at `at` (statuses 1, 2, 3, 6) or release its future entry (4).
local function cal_commit(status, at)
  if na == 0 or mode == 2 then return end
  for a = 1, na do
    local c = cal[a]
    if status == 1 or status == 2 or status == 3 or status == 6 then
      -- the entry, its window's new weight and the expiry, in one ZADD
      local j = cal_index(c, at)
      local write = {at, c.member}
      if c.own ~= j then
        if c.own and c.own >= c.cur then cal_add(c, c.own, -c.cost) end
        local name = cal_name(c, j)
        c.counts[name] = cal_used(c, j) + c.cost
        write[3], write[4] = c.counts[name], name
        c.own = j
      end
      local till = cal_start(c, j + 1) + CAL_KEEP_MS * 1000
      if till > c.expiry then
        write[#write + 1], write[#write + 2] = -till, '~'
        redis.call('ZADD', c.key, unpack(write))
        redis.call('PEXPIRE', c.key, math.ceil((till - now) / 1000))
        c.expiry = till
      else
        redis.call('ZADD', c.key, unpack(write))
      end
    elseif status == 4 and c.own and c.own_at > now then
      if c.own >= c.cur then cal_add(c, c.own, -c.cost) end
      redis.call('ZREM', c.key, c.member)
      c.own = nil
    end
  end
end

-- Settle (mode 9): the call's entry, counted at weight was[aidx + a], now weighs its
-- cost; its window's weight follows if the window has not ended. Returns how many
-- entries were found.
local function cal_settle(was)
  local found = 0
  for a = 1, na do
    local c, w = cal[a], was[aidx + a]
    local old = w == 1 and token or token .. '.' .. w
    local s = redis.call('ZSCORE', c.key, old)
    if s then
      found = found + 1
      s = tonumber(s)
      redis.call('ZREM', c.key, old)
      redis.call('ZADD', c.key, s, c.member)
      local j = cal_index(c, s)
      if j >= c.cur then cal_add(c, j, c.cost - w) end
    end
  end
  return found
end

-- Fold the aligned limits into a reply's remaining weight (nil: none yet) and
-- reset_after (µs until every window counted in has ended).
local function cal_reply(remaining, reset)
  for a = 1, na do
    local c = cal[a]
    local free = c.limit - cal_used(c, c.cur)
    if remaining == nil or free < remaining then remaining = free end
    for name, used in pairs(c.counts) do
      if used > 0 then
        local r = cal_start(c, cal_index(c, tonumber(string.sub(name, 2))) + 1) - now
        if r > reset then reset = r end
      end
    end
  end
  return remaining, reset
end

if na > 0 and (mode <= 3 or mode == 5) then
  local s, by = cal_at(gate)
  if s > gate then gate, gate_by = s, aidx + by end
end
