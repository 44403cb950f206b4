-- acquire.lua — the plain decision: count a call now against every limit of its key,
-- all or nothing, or reserve it; for a call whose limits are all unpaced sliding logs,
-- counted at cost 1, with no lead. Everything else (pace, lead, weights, an upstream's
-- observed budget, a slot abandoned in a full window) is acquire_full.lua's, which
-- decides the same calls with the same data (lib/log.lua).
--
-- KEYS  the log of each limit (n), its pending set (n), its key's settings hash (n)
-- ARGV  1 token (8 bytes), 2 flag, 3 n, 4-5 "0" "0", 6 horizon µs, 7 guard µs,
--       8 hold µs, then (limit, window µs, cost) of each limit: as lib/call.lua's
-- flag  "now": count it now, or deny (status 1 or 0); "reserve": count it now, else at
--       the earliest instant it fits within the horizon (status 2, the slot kept in the
--       pending set; 6 when within `hold`), else deny; "peek": as "now", writing nothing
-- Reply {status, remaining, retry_after, reset_after, denied_by, at} (lib/call.lua), or
--       {8}: send this call to acquire_full.lua; only expired entries were removed

local ENTRY_FLOOR = 1e13
local PRUNE_BATCH = 500
-- as lib/entry.lua and lib/log.lua (tests/test_layout.py)
local TTL_MARGIN_MS = 1000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token, flag, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local horizon, guard, hold = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local write = flag ~= 'peek'
if #ARGV ~= 8 + 3 * n then return {8} end  -- a pace or a lead

-- the settings of each limit's key: a pause holds the call until then; a rate override
-- in force replaces the limit of its window, or of any window for its key's only limit
local ks, gate, paused = {}, now, false
for i = 1, n do
  local a = 6 + 3 * i
  local limit, window, cost = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local s = redis.call('HMGET', KEYS[2 * n + i], 'pause', 'rate', 'up')
  if s[3] then return {8} end
  if tonumber(s[1] or 0) > gate then gate, paused = tonumber(s[1]), true end
  local l, w, u = string.match(s[2] or '', '^(%d+) (%d+) (%d+)$')
  if l and (tonumber(u) == 0 or tonumber(u) > now) then
    local alone = true
    for j = 1, n do
      if j ~= i and KEYS[2 * n + j] == KEYS[2 * n + i] then alone = false end
    end
    if tonumber(w) == window or alone then
      limit, window = math.max(tonumber(l), cost), tonumber(w)
    end
  end
  local slack = math.min(guard, math.floor(window / 25))
  ks[i] = {key = KEYS[i], pending = KEYS[n + i], limit = limit, cost = cost,
    window = window + slack, exact = window + math.floor(slack / 2)}
end

-- each log's meta members ("" total, "+" newest, "=" unit, "~" expiry: lib/log.lua),
-- its expired entries pruned (counted only, on a peek), a batch at a time when many
for _, k in ipairs(ks) do
  local m = redis.call('ZMSCORE', k.key, '', '+', '=', '~')
  k.total, k.newest = tonumber(m[1] or 0), -tonumber(m[2] or 0)
  k.unit, k.expiry, k.stale = tonumber(m[3] or 0), -tonumber(m[4] or 0), 0
  if k.total > 0 and k.unit ~= 1 then return {8} end  -- weighted entries
  local cutoff = now - k.window
  if k.total > 0 and k.newest <= cutoff and k.total <= PRUNE_BATCH then
    if write then redis.call('DEL', k.key) end
    k.total, k.newest, k.expiry, k.unit = 0, 0, 0, 0
  elseif k.total > 0 then
    local gone
    if write and k.total <= PRUNE_BATCH then
      gone = redis.call('ZREMRANGEBYSCORE', k.key, ENTRY_FLOOR, cutoff)
      k.dirty = gone > 0
    else
      gone = redis.call('ZCOUNT', k.key, ENTRY_FLOOR, cutoff)
      if write and gone > 0 then
        local upto = cutoff
        if gone > PRUNE_BATCH then
          local edge = redis.call('ZCOUNT', k.key, '-inf', '(' .. ENTRY_FLOOR) + PRUNE_BATCH - 1
          upto = redis.call('ZRANGE', k.key, edge, edge, 'WITHSCORES')[2]
        end
        k.stale = gone - redis.call('ZREMRANGEBYSCORE', k.key, ENTRY_FLOOR, upto)
        k.dirty = true
      end
    end
    k.total = math.max(k.total - gone, 0)
  end
end

-- the reply, the running totals that pruning changed written back
local function answer(status, at, retry_after, denied_by)
  local remaining, reset = nil, 0
  for _, k in ipairs(ks) do
    if write and k.dirty then redis.call('ZADD', k.key, k.total + k.stale, '') end
    if remaining == nil or k.limit - k.total < remaining then remaining = k.limit - k.total end
    if k.total > 0 and k.newest + k.window - now > reset then reset = k.newest + k.window - now end
  end
  return {status, math.max(remaining or 0, 0), math.max(retry_after, 0), reset, denied_by, at}
end

-- the call's entry at `at` (and, for a reservation, its slot), with the meta members
-- in the same ZADD; the key's expiry extended only when this entry outlives it
local function add(k, at, slot)
  local z = {at, token, k.total + k.stale + 1, ''}
  if k.total + k.stale == 0 then z[5], z[6] = 1, '=' end
  if at > k.newest then z[#z + 1], z[#z + 2], k.newest = -at, '+', at end
  k.total, k.dirty = k.total + 1, false
  if at + k.window > k.expiry then
    local ttl = math.ceil((at + k.window - now) / 1000) + TTL_MARGIN_MS
    z[#z + 1], z[#z + 2] = -(now + ttl * 1000), '~'
    redis.call('ZADD', k.key, unpack(z))
    redis.call('PEXPIRE', k.key, ttl)
  else
    redis.call('ZADD', k.key, unpack(z))
  end
  if slot then
    redis.call('ZREMRANGEBYSCORE', k.pending, '-inf', now - k.window)
    redis.call('ZADD', k.pending, at, token)
    local ttl = math.ceil((at + k.window - now) / 1000) + TTL_MARGIN_MS
    if redis.call('PTTL', k.pending) < ttl then redis.call('PEXPIRE', k.pending, ttl) end
  end
end

-- allowed now: the call fits every limit, nothing pausing it
local at, denied_by = now, 0
for i, k in ipairs(ks) do
  if k.total + 1 > k.limit then
    -- full: a slot abandoned in its window may give room (acquire_full.lua's to weigh)
    if redis.call('ZCOUNT', k.pending, string.format('(%.0f', now - k.exact),
        math.floor(now - k.exact / 4)) > 0 then
      answer(0, now, 0, 0)
      return {8}
    end
    -- the earliest instant one entry has left: the (total + 1 - limit)-th entry's,
    -- found by rank (meta members rank first)
    local nth = redis.call('ZCOUNT', k.key, '-inf', string.format('%.0f', now - k.window))
      + k.total + 1 - k.limit - 1
    local row = redis.call('ZRANGE', k.key, nth, nth, 'WITHSCORES')
    local s = row[2] and tonumber(row[2]) + k.window or now + k.window
    if s > at then at, denied_by = s, i end
  end
end
if gate > at then at, denied_by = gate, n + 1 end
if denied_by == 0 then
  if write then
    for _, k in ipairs(ks) do add(k, now, false) end
  end
  return answer(1, now, 0, 0)
end
if flag ~= 'reserve' or at - now > horizon then return answer(0, now, at - now, denied_by) end
local status = at - now > hold and 2 or 6
for _, k in ipairs(ks) do add(k, at, status == 2) end
return answer(status, at, at - now, denied_by)
