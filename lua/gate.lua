-- gate.lua — what holds a call back besides its rate limits: a pause of its keys (an
-- upstream's 429) and its concurrency limits. Included by sliding_log.lua,
-- sliding_counter.lua and concurrency.lua once they have set `now`, `token`, `mode`,
-- `nc`, `ns`, `cbase`, `sbase`, `coff` and `nlimits` (the call's rate limits).
--
-- KEYS[cbase + 3j - 2 .. cbase + 3j]  concurrency limit j:
--   holders  sorted set: token -> the instant its lease runs out (µs); meta member ""
--            (scored below ENTRY_FLOOR) = the average time a body held a slot (µs)
--   starts   sorted set: token -> the instant its body started (µs)
--   waiters  sorted set: token -> the instant its turn is expected (µs): denied calls
--            that reserved a turn, in order; one later than its turn by more than GRACE
--            gives its turn up (its task competes afresh if it ever comes)
-- KEYS[sbase + i]  the settings hash of the call's i-th key: "pause" = until (µs);
--            "rate" = "limit window_us until_us" (until 0: no end), a rate override
--            of the key's rate limit of that window, or of its only one whatever its
--            window (see `rated`)
-- numbers from byte coff of ARGV[2]: (most, lease µs) of every concurrency limit
--
-- A call may start when every key is unpaused and, for every concurrency limit, fewer
-- than `most` bodies hold a slot besides the waiters whose turn has come before it.
-- Otherwise `gate` is the instant it is expected to: a pause's end, or, for a full
-- limit, its turn: the n-th waiter in line (counting from 0) gets lane n % most, after
-- n // most bodies of the average time ahead of it there; a lane is free when its
-- holder's body is expected to end (its start plus the average time). Turns in line
-- keep their order, so a queue of waiters comes back one by one, not all at once.
--
-- Extra modes: 6 renew this token's leases; 7 pause every settings key for `horizon`
-- µs (a later end wins); 8 set the rate override of every settings key to `guard`
-- per `hold` µs for `horizon` µs (0: no end), or remove it (`guard` 0). They reply
-- {1 or 0, 0, 0, 0, 0, until or now}.

local GRACE = 2000000
-- A guess of a body's time before any body has ended: what the longest-running one
-- has taken so far, at least this (µs). Too short costs a waiter one more check; too
-- long would leave slots idle.
local FIRST_GUESS = 100000
-- Keys are kept this long (ms) after a write, with the average time they have learnt.
local KEEP_MS = 86400000
local PAUSED = nlimits + nc + 1

local gate, gate_by, gate_firm = now, 0, true
local cs = {}
if nc > 0 then
  local cn = {struct.unpack('<' .. string.rep('d', 2 * nc), ARGV[2], coff)}
  for j = 1, nc do
    local b = cbase + 3 * j - 3
    cs[j] = {h = KEYS[b + 1], s = KEYS[b + 2], w = KEYS[b + 3],
      most = cn[2 * j - 1], lease = cn[2 * j], free = 0}
  end
end

if mode == 7 then
  local till = now + horizon
  for i = 1, ns do
    local key = KEYS[sbase + i]
    local old = tonumber(redis.call('HGET', key, 'pause') or 0)
    if old > till then till = old end
    redis.call('HSET', key, 'pause', till)
    -- the hash lasts at least as long as the pause (for good with a lasting override)
    local ttl = redis.call('PTTL', key)
    if ttl ~= -1 and ttl < math.ceil((till - now) / 1000) + 1000 then
      redis.call('PEXPIRE', key, math.ceil((till - now) / 1000) + 1000)
    end
  end
  return {1, 0, till - now, 0, 0, till}
end
if mode == 8 then
  local till = horizon > 0 and now + horizon or 0
  for i = 1, ns do
    local key = KEYS[sbase + i]
    if guard > 0 then
      redis.call('HSET', key, 'rate', string.format('%.0f %.0f %.0f', guard, hold, till))
    else
      redis.call('HDEL', key, 'rate')
    end
    -- the hash lasts as long as its override (for good: `till` 0) or its pause
    local last = math.max(till, tonumber(redis.call('HGET', key, 'pause') or 0))
    if guard > 0 and till == 0 then
      redis.call('PERSIST', key)
    elseif last > now then
      redis.call('PEXPIRE', key, math.ceil((last - now) / 1000) + 1000)
    else
      redis.call('DEL', key)
    end
  end
  return {1, 0, 0, 0, 0, till > 0 and till or now}
end

-- The settings of the call's keys: pauses (read below) and rate overrides, settings
-- index -> {limit, window}; nil when there is none (the usual case).
local pauses, overrides = {}, nil
if mode <= 5 then
  for i = 1, ns do
    local s = redis.call('HMGET', KEYS[sbase + i], 'pause', 'rate')
    pauses[i] = tonumber(s[1] or 0)
    if s[2] and i <= nlimits then
      local l, w, u = string.match(s[2], '^(%d+) (%d+) (%d+)$')
      if l and (tonumber(u) == 0 or tonumber(u) > now) then
        overrides = overrides or {}
        overrides[i] = {tonumber(l), tonumber(w)}
      end
    end
  end
end

-- Rate limit i's limit and window (µs), after its key's override if there is one: an
-- override of the same window, or one of any window when the limit is the key's only
-- rate limit in this call. A cost above the new limit counts as the whole limit (the
-- call runs alone in its window rather than never).
local function rated(i, limit, window, cost)
  local o = overrides and overrides[i]
  if not o then return limit, window end
  if o[2] ~= window then
    for j = 1, nlimits do
      if j ~= i and KEYS[sbase + j] == KEYS[sbase + i] then return limit, window end
    end
  end
  return math.max(o[1], cost), o[2]
end
if mode == 6 then
  local kept = 1
  for j = 1, nc do
    local c = cs[j]
    if redis.call('ZSCORE', c.h, token) then
      redis.call('ZADD', c.h, now + c.lease, token)
    else
      kept = 0
    end
  end
  return {kept, 0, 0, 0, 0, now}
end

-- The expected turn of the waiter `rank` places back in line under c.
local function turn(c, starts, rank)
  local avg = tonumber(redis.call('ZSCORE', c.h, '') or 0)
  if avg <= 0 then
    avg = FIRST_GUESS
    if #starts > 0 and now - tonumber(starts[2]) > avg then avg = now - tonumber(starts[2]) end
  end
  local lanes = {}
  for i = 2, #starts, 2 do
    -- a body past its expected end is expected within an eighth of the average
    lanes[#lanes + 1] = math.max(tonumber(starts[i]) + avg, now + math.floor(avg / 8))
  end
  table.sort(lanes)
  while #lanes > c.most do table.remove(lanes, 1) end
  for _ = #lanes + 1, c.most do table.insert(lanes, 1, now) end
  return lanes[rank % c.most + 1] + math.floor(rank / c.most) * avg
end

if mode <= 3 then
  for i = 1, ns do
    if pauses[i] > gate then gate, gate_by = pauses[i], PAUSED end
  end
  for j = 1, nc do
    local c = cs[j]
    local lapsed = redis.call('ZRANGEBYSCORE', c.h, ENTRY_FLOOR, now)
    if #lapsed > 0 and mode ~= 2 then
      -- a lost worker's bodies: their slots come back
      redis.call('ZREM', c.s, unpack(lapsed))
      redis.call('ZREMRANGEBYSCORE', c.h, ENTRY_FLOOR, now)
    end
    if mode ~= 2 then redis.call('ZREMRANGEBYSCORE', c.w, '-inf', '(' .. string.format('%.0f', now - GRACE)) end
    local starts = redis.call('ZRANGE', c.s, 0, -1, 'WITHSCORES')
    local held = #starts / 2 - (mode == 2 and #lapsed or 0)
    local mine = mode == 3 and redis.call('ZSCORE', c.w, token)
    -- ahead: the waiters whose turn has come before this call's; rank: its place in
    -- line (a new call's is at the back)
    local ahead, rank
    if mine then
      rank = redis.call('ZCOUNT', c.w, now - GRACE, '(' .. mine)
      ahead = tonumber(mine) <= now and rank or redis.call('ZCOUNT', c.w, now - GRACE, now)
    else
      ahead = redis.call('ZCOUNT', c.w, now - GRACE, now)
      rank = redis.call('ZCOUNT', c.w, now - GRACE, '+inf')
    end
    c.free = c.most - held - ahead
    if c.free <= 0 then
      local at = turn(c, starts, rank)
      if at > gate then gate, gate_by, gate_firm = at, nlimits + j, false end
    end
  end
end

-- Write what the call's answer means for its concurrency limits: a start takes a slot,
-- a reservation keeps a place in line, a release frees both (and teaches the average).
local function commit(status, at)
  if nc == 0 or mode == 2 then return end
  for j = 1, nc do
    local c = cs[j]
    if status == 1 or status == 6 then
      redis.call('ZADD', c.h, at + c.lease, token)
      redis.call('ZADD', c.s, at, token)
      redis.call('ZREM', c.w, token)
      c.free = c.free - 1
    elseif status == 2 or status == 3 then
      redis.call('ZREM', c.h, token)
      redis.call('ZREM', c.s, token)
      redis.call('ZADD', c.w, at, token)
    elseif status == 4 then
      redis.call('ZREM', c.w, token)
      local start = redis.call('ZSCORE', c.s, token)
      if start then
        local took = now - tonumber(start)
        local avg = tonumber(redis.call('ZSCORE', c.h, '') or 0)
        avg = avg > 0 and avg + (took - avg) / 4 or took
        redis.call('ZADD', c.h, math.max(math.floor(avg), 1), '')
        redis.call('ZREM', c.h, token)
        redis.call('ZREM', c.s, token)
      end
    end
    if status ~= 0 and status ~= 5 then
      for _, key in ipairs({c.h, c.s, c.w}) do
        redis.call('PEXPIRE', key, KEEP_MS + math.ceil(c.lease / 1000))
      end
    end
  end
end

-- The fewest free slots of the call's concurrency limits after it (nil if none).
local function conc_free()
  local free = nil
  for j = 1, nc do
    local f = math.max(cs[j].free, 0)
    if free == nil or f < free then free = f end
  end
  return free
end
