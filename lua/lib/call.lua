-- lib/call.lua — a decision's KEYS and ARGV read into tables, the settings of its keys
-- (a pause, a rate override), and its reply. Functions only: every script that
-- includes this file calls them with its own KEYS and ARGV.
--
-- KEYS of a decision, in this order:
--   the key of each sliding rate limit (n): the log's sorted set or the counter's hash
--   the pending set of each of those, for the log only (n)
--   the sorted set of each calendar-aligned limit (na)
--   holders, starts and waiters of each concurrency limit (3 * nc)
--   the settings hash of each limit's key, in the same order (n + na + nc)
--   a fair limit's queue, when the call has one: its tags and its state (lib/fair.lua)
-- ARGV of a decision:
--   1  token: 8 bytes, unique per call; the member the call's entries are written as
--   2  the script's flag (see each script's header)
--   3, 4, 5  n, na, nc
--   6  horizon, µs: nothing is reserved further ahead than this
--   7  guard, µs: windows are placed g = min(guard, W / 25) wider than W, while a start
--      is checked in a window g / 2 wider (a body begins a moment after its check)
--   8  hold, µs: a start due no further ahead than this is granted for that instant
--      (status 6) and the caller waits for it in-process; 0: never
--   9  lead, µs: an acquisition's grant is counted this long after now (0: now)
--   then (limit, window µs, cost, burst) of each sliding limit (burst 0: not paced, see
--   lib/pace.lua; a paced call's script is composed with it), (limit, window µs, cost)
--   of each aligned limit, the six window boundaries (µs) of each aligned limit (see
--   lib/calendar.lua), and (most, lease µs) of each concurrency limit;
--   a call with a fair queue adds its fair-key value and its weight; a settle adds,
--   last, the weight each rate limit counted the call at.
--
-- Reply: {status, remaining, retry_after, reset_after, denied_by, at}, integers:
--   status       0 denied, 1 allowed now, 2 reserved for `at`, 3 the reservation is
--                held but not yet due, 4 released, 5 a task already started on this
--                reservation (acquire anew), 6 started at `at`, within `hold` from
--                now: run then, without a second call, 7 settled (0: nothing found)
--   remaining    weight still free in the tightest limit, counting reservations
--   retry_after  µs until this cost fits every limit (0 when allowed now)
--   reset_after  µs until every limit of the call is back to full
--   denied_by    1-based index of the limit that set retry_after (sliding, aligned,
--                then concurrency limits; one more than all of them: a pause), 0 if none
--   at           server time of the decision, or the instant the call counts at, µs

--- @include "lib/entry.lua"

local function read_call(keys, argv, pending)
  local t = redis.call('TIME')
  local c = {now = tonumber(t[1]) * 1000000 + tonumber(t[2]), token = argv[1],
    flag = argv[2], horizon = tonumber(argv[6]), guard = tonumber(argv[7]),
    hold = tonumber(argv[8]), lead = tonumber(argv[9]), logs = {}, cals = {}, concs = {},
    settings = {}}
  local n, na, nc = tonumber(argv[3]), tonumber(argv[4]), tonumber(argv[5])
  local a, k = 10, n + 1
  if pending then k = 2 * n + 1 end
  for i = 1, n do
    c.logs[i] = {key = keys[i], pending = pending and keys[n + i] or nil,
      limit = tonumber(argv[a]), window = tonumber(argv[a + 1]), cost = tonumber(argv[a + 2])}
    local burst = tonumber(argv[a + 3])
    if burst > 0 then c.logs[i].burst = burst end
    a = a + 4
  end
  for j = 1, na do
    c.cals[j] = {key = keys[k], limit = tonumber(argv[a]), window = tonumber(argv[a + 1]),
      cost = tonumber(argv[a + 2])}
    k, a = k + 1, a + 3
  end
  for j = 1, na do
    local b = {}
    for m = 0, 5 do b[m + 1] = tonumber(argv[a + m]) end
    c.cals[j].b = b
    a = a + 6
  end
  for j = 1, nc do
    c.concs[j] = {h = keys[k], s = keys[k + 1], w = keys[k + 2], most = tonumber(argv[a]),
      lease = tonumber(argv[a + 1]), free = 0}
    k, a = k + 3, a + 2
  end
  for i = k, k + n + na + nc - 1 do c.settings[#c.settings + 1] = keys[i] end
  c.rest = a  -- the first ARGV after the call's numbers
  local q = k + n + na + nc
  if keys[q] then
    -- a fair queue (lib/fair.lua): its two keys last, its value and weight after the numbers
    c.fair = {tags = keys[q], state = keys[q + 1], value = argv[a], weight = tonumber(argv[a + 1])}
    c.rest = a + 2
  end
  c.paused_by = n + na + nc + 1
  return c
end

-- The fields of a limit's settings hash that hold what the upstream said of it (see
-- lua/observe.lua) and its effective rate (Limit(adapt=True), lib/settings.lua's
-- settings_cut): "seen:" and "eff:" .. the algorithm and window its key ends with.
local function settings_fields(spec)
  local limit = string.match(spec.key, '([^:]+:%d+)$')
  return 'seen:' .. limit, 'eff:' .. limit
end

-- What an upstream said of the limit `spec` (index i, settings hash `key`): see
-- read_settings. Returns the gate and its index as they now are.
local function read_seen(c, spec, key, i, observed, gate, by)
  local seen, eff = settings_fields(spec)
  local said = redis.call('HMGET', key, seen, eff)
  if said[2] then
    local e, cut, step = string.match(said[2], '^(%d+) (%d+) (%d+)$')
    if e then
      local most = tonumber(e) + math.floor((c.now - tonumber(cut)) / spec.window) * tonumber(step)
      if most < spec.limit then spec.limit = math.max(most, spec.cost) end
    end
  end
  local r, t, l, lu = string.match(said[1] or '', '^(%d+) (%d+) (%d+) (%d+)$')
  if r then
    r, t, l, lu = tonumber(r), tonumber(t), tonumber(l), tonumber(lu)
    if l > 0 and lu > c.now and l < spec.limit then spec.limit = math.max(l, spec.cost) end
    if observed and t > c.now then
      spec.seen = {key = key, field = seen, r = r, t = t, l = l, lu = lu}
      c.seen = c.seen or {}
      c.seen[#c.seen + 1] = spec
      if r < spec.cost and t > gate then gate, by = t, i end
    end
  end
  return gate, by
end

-- Read the settings hashes of the call's keys: returns the earliest instant the call
-- may start at as far as a pause of any of them says (now if none) and the index of a
-- pause in replies (0: none); and puts each rate override in force into the limit it
-- applies to — a limit of the same window, or any window when the limit is the only rate
-- limit of its key in the call. An aligned limit takes only an override of its own
-- window (its windows are the calendar's). A cost above the new limit counts as the
-- whole limit: the call runs alone in its window rather than never.
-- What an upstream said of a limit (its "seen:" field, "r t l lu") applies too: a limit
-- of l units observed lowers the limit to l until lu; and with `observed`, r units left
-- until t hold the call back until t when its cost does not fit them (that limit's
-- index in replies), the limit being put in c.seen for seen_take (lib/seen.lua). An effective rate
-- ("eff:" field, "e cut step": e units a window at the instant cut, step more for each
-- whole window since) lowers the limit while below it. Those two fields are read only
-- from a hash whose "up" field says an upstream was observed on the key: a key nothing
-- was observed on pays one field more.
local function read_settings(c, observed)
  local gate, by, n = c.now, 0, #c.logs
  for i, key in ipairs(c.settings) do
    local spec = i <= n and c.logs[i] or c.cals[i - n]
    local s = redis.call('HMGET', key, 'pause', 'rate', 'up')
    local until_us = tonumber(s[1] or 0)
    if until_us > gate then gate, by = until_us, c.paused_by end
    if s[2] and spec then
      local l, w, u = string.match(s[2], '^(%d+) (%d+) (%d+)$')
      if l and (tonumber(u) == 0 or tonumber(u) > c.now) then
        l, w = tonumber(l), tonumber(w)
        local alone = true
        for j = 1, n + #c.cals do
          if j ~= i and c.settings[j] == key then alone = false end
        end
        if w == spec.window or (alone and not spec.b) then
          spec.limit, spec.window = math.max(l, spec.cost), w
        end
      end
    end
    if s[3] and spec then gate, by = read_seen(c, spec, key, i, observed, gate, by) end
  end
  return gate, by
end
