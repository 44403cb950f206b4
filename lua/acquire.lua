-- acquire.lua — the plain decision: count a call now against every limit of its key,
-- all or nothing, or reserve it; for unpaced sliding logs and no lead. The rest ({8}) is
-- acquire_full.lua's, which decides the same calls with the same data (lib/log.lua). A
-- call of one limit goes to acquire_one.lua, this decision without the walk over limits.
--
-- KEYS  the log of each limit (n), its pending set (n), its key's settings hash (n)
-- ARGV  1 token (8 bytes), 2 flag, 3 n, 4-5 "0" "0", 6 horizon µs, 7 guard µs,
--       8 hold µs, 9 lead "0", then (limit, window µs, cost, burst "0") of each limit:
--       as lib/call.lua's (scripts.Shape.plain)
-- flag  "now": count it now, or deny (status 1 or 0); "reserve": count it now, else at
--       the earliest instant it fits within the horizon (status 2, the slot kept in the
--       pending set; 6 when within `hold`), else deny; "peek": as "now", writing nothing
-- Reply {status, remaining, retry_after, reset_after, denied_by, at} (lib/call.lua), or
--       {8}: send this call to acquire_full.lua (pace, lead, entries of another weight,
--       an upstream's observed budget, more than PRUNE_BATCH expired entries, and in a
--       full window a slot abandoned or reservations ahead of a paused key or of one of
--       several limits); only expired entries were removed

--- @include "lib/fit.lua"

local ENTRY_FLOOR = 1e13
local PRUNE_BATCH = 500
-- as lib/entry.lua and lib/log.lua (tests/test_layout.py)
local TTL_MARGIN_MS = 1000
local call, tonumber, floor = redis.call, tonumber, math.floor
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token, flag, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local write = flag ~= 'peek'
if #ARGV ~= 9 + 4 * n or ARGV[9] ~= '0' then return {8} end
local guard = tonumber(ARGV[7])

-- each limit: its key's settings (a pause holds the call until then; a rate override in
-- force replaces the limit of its window, or of any window for its key's only limit),
-- then its log's meta members ("" total, "+" newest, "=" unit, "~" expiry: lib/log.lua),
-- its expired entries pruned (counted only, on a peek; more than PRUNE_BATCH: {8});
-- then whether the call fits. A limit's state is kept by position (KEY .. MEMBER).
local KEY, LIMIT, WINDOW, TOTAL, NEWEST, EXPIRY, DIRTY, COST, MEMBER = 1, 2, 3, 4, 5, 6, 7, 8, 9
local ks, gate, s, status, at, denied_by = {}, now, nil, 1, now, 0
for i = 1, n do
  local a = 6 + 4 * i
  if ARGV[a + 3] ~= '0' then status = 8 break end  -- a paced limit
  local limit, window, cost = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local hash = KEYS[2 * n + i]
  if i == 1 or hash ~= KEYS[2 * n + i - 1] then s = call('HMGET', hash, 'pause', 'rate', 'up') end
  if s[3] then status = 8 break end  -- an upstream's observed budget
  if s[1] and tonumber(s[1]) > gate then gate = tonumber(s[1]) end
  if s[2] then
    local l, w, u = string.match(s[2], '^(%d+) (%d+) (%d+)$')
    if l and (tonumber(u) == 0 or tonumber(u) > now) then
      local alone = true
      for j = 1, n do
        if j ~= i and KEYS[2 * n + j] == hash then alone = false end
      end
      if tonumber(w) == window or alone then
        limit, window = math.max(tonumber(l), cost), tonumber(w)
      end
    end
  end
  local slack = guard
  if window / 25 < slack then slack = floor(window / 25) end
  local exact = window + floor(slack / 2)
  window = window + slack
  local key = KEYS[i]
  local m = call('ZMSCORE', key, '', '+', '=', '~')
  local total, newest, expiry, dirty = tonumber(m[1] or 0), -tonumber(m[2] or 0),
    -tonumber(m[4] or 0), false
  if total > 0 then
    if tonumber(m[3]) ~= cost then status = 8 break end  -- entries of another weight
    local cutoff, gone = now - window, 0
    if newest <= cutoff and total <= PRUNE_BATCH * cost then
      if write then call('DEL', key) end
      total, newest, expiry = 0, 0, 0
    elseif write and total <= PRUNE_BATCH * cost then
      gone = call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
      dirty = gone > 0
    else
      gone = call('ZCOUNT', key, ENTRY_FLOOR, cutoff)
      if write and gone > PRUNE_BATCH then status = 8 break end  -- pruned a batch a call
      if write and gone > 0 then
        call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
        dirty = true
      end
    end
    total = total - gone * cost
    if total < 0 then total = 0 end
  end
  ks[i] = {key, limit, window, total, newest, expiry, dirty, cost,
    cost == 1 and token or token .. '.' .. cost}
  if total + cost > limit then
    -- full. acquire_full.lua's: reservations ahead of a paused key or of one of several
    -- limits (placed where they fit all: lib/log_search.lua, logs_place), and a slot
    -- abandoned in the window (it may give room)
    local abandoned = string.format('(%.0f', now - exact)
    if (newest > now and (n > 1 or gate > now))
      or call('ZCOUNT', KEYS[n + i], abandoned, floor(now - exact / 4)) > 0 then
      status = 8
      break
    end
    -- the earliest instant enough entries have left: the ceil((total + cost - limit) /
    -- cost)-th entry's, by rank (meta members rank first); every instant from it fits.
    -- With reservations ahead, a hole in their line may come first (lib/fit.lua)
    local nth = call('ZCOUNT', key, '-inf', string.format('%.0f', now - window))
      + math.ceil((total + cost - limit) / cost) - 1
    local row = call('ZRANGE', key, nth, nth, 'WITHSCORES')
    local free = row[2] and tonumber(row[2]) + window or now + window
    if newest > now then free = fit_at(key, now, window, limit - cost, cost, counted_room, free) end
    if free > at then at, denied_by = free, i end
  end
end
local retry_after = 0
if status ~= 8 then
  if gate > at then at, denied_by = gate, n + 1 end
  if denied_by > 0 then
    retry_after = at - now
    if flag ~= 'reserve' or retry_after > tonumber(ARGV[6]) then
      status, at = 0, now
    elseif retry_after > tonumber(ARGV[8]) then
      status = 2
    else
      status = 6
    end
  end
end

-- the call's entry at `at` (a reservation's slot too) with the meta members in one ZADD
-- (the expiry extended only when the entry outlives it), or pruned totals written back
local remaining, reset, counted = nil, 0, write and status ~= 0 and status ~= 8
for i = 1, #ks do
  local k = ks[i]
  local key, window, total, newest, cost = k[KEY], k[WINDOW], k[TOTAL], k[NEWEST], k[COST]
  if counted then
    if total > 0 and at > newest and at + window <= k[EXPIRY] then
      -- the usual entry: one more of the one weight, the newest
      call('ZADD', key, at, k[MEMBER], total + cost, '', -at, '+')
    else
      local z = {at, k[MEMBER], total + cost, ''}
      if total == 0 then z[5], z[6] = cost, '=' end
      if at > newest then z[#z + 1], z[#z + 2] = -at, '+' end
      if at + window > k[EXPIRY] then
        local ttl = math.ceil((at + window - now) / 1000) + TTL_MARGIN_MS
        z[#z + 1], z[#z + 2] = -(now + ttl * 1000), '~'
        call('ZADD', key, unpack(z))
        call('PEXPIRE', key, ttl)
      else
        call('ZADD', key, unpack(z))
      end
    end
    if status == 2 then
      local pending = KEYS[n + i]
      call('ZREMRANGEBYSCORE', pending, '-inf', now - window)
      call('ZADD', pending, at, k[MEMBER])
      local ttl = math.ceil((at + window - now) / 1000) + TTL_MARGIN_MS
      if call('PTTL', pending) < ttl then call('PEXPIRE', pending, ttl) end
    end
    total = total + cost
    if at > newest then newest = at end
  elseif write and k[DIRTY] then
    call('ZADD', key, total, '')
  end
  if remaining == nil or k[LIMIT] - total < remaining then remaining = k[LIMIT] - total end
  if total > 0 and newest + window - now > reset then reset = newest + window - now end
end
if status == 8 then return {8} end
if remaining == nil or remaining < 0 then remaining = 0 end
return {status, remaining, retry_after, reset, denied_by, at}
