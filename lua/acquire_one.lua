-- acquire_one.lua — the plain decision of a call with one limit: acquire.lua's, for an
-- unpaced sliding log and no lead, without its walk over limits (its loops, per-limit
-- arrays and shared functions cost Redis time on every call: docs/benchmarks.md, 2b).
-- What it leaves ({8}) is acquire_full.lua's, as for acquire.lua.
-- tests/test_limiter_properties.py holds the three to one model.
--
-- KEYS  1 the limit's log, 2 its pending set, 3 its key's settings hash
-- ARGV  as acquire.lua's for one limit: 1 token (8 bytes), 2 flag, 3 "1", 4-5 "0" "0",
--       6 horizon µs, 7 guard µs, 8 hold µs, 9 lead "0", 10 limit, 11 window µs,
--       12 cost, 13 burst "0"
-- flag  "now", "reserve" or "peek", as acquire.lua's
-- Reply {status, remaining, retry_after, reset_after, denied_by, at}, or {8}, as
--       acquire.lua's

local ENTRY_FLOOR = 1e13
local PRUNE_BATCH = 500
-- as lib/entry.lua and lib/log.lua (tests/test_layout.py)
local TTL_MARGIN_MS = 1000
local call, tonumber, floor = redis.call, tonumber, math.floor
if #ARGV ~= 13 or ARGV[9] ~= '0' or ARGV[13] ~= '0' then return {8} end
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token, flag = ARGV[1], ARGV[2]
local write = flag ~= 'peek'
local limit, window, cost = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local key, pending = KEYS[1], KEYS[2]

-- the key's settings: a pause holds the call until then; a rate override in force
-- replaces the limit and its window (the key's only limit)
local s = call('HMGET', KEYS[3], 'pause', 'rate', 'up')
if s[3] then return {8} end  -- an upstream's observed budget
local gate = now
if s[1] and tonumber(s[1]) > gate then gate = tonumber(s[1]) end
if s[2] then
  local l, w, u = string.match(s[2], '^(%d+) (%d+) (%d+)$')
  if l and (tonumber(u) == 0 or tonumber(u) > now) then
    limit, window = math.max(tonumber(l), cost), tonumber(w)
  end
end
local slack = tonumber(ARGV[7])
if window / 25 < slack then slack = floor(window / 25) end
local exact = window + floor(slack / 2)
window = window + slack

-- the log's meta members ("" total, "+" newest, "=" unit, "~" expiry: lib/log.lua), its
-- expired entries pruned (counted only, on a peek; more than PRUNE_BATCH: {8})
local m = call('ZMSCORE', key, '', '+', '=', '~')
local total, newest, expiry, dirty = tonumber(m[1] or 0), -tonumber(m[2] or 0),
  -tonumber(m[4] or 0), false
if total > 0 then
  if tonumber(m[3]) ~= cost then return {8} end  -- entries of another weight
  local cutoff, gone = now - window, 0
  if newest <= cutoff and total <= PRUNE_BATCH * cost then
    if write then call('DEL', key) end
    total, newest, expiry = 0, 0, 0
  elseif write and total <= PRUNE_BATCH * cost then
    gone = call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
    dirty = gone > 0
  else
    gone = call('ZCOUNT', key, ENTRY_FLOOR, cutoff)
    if write and gone > PRUNE_BATCH then return {8} end  -- pruned a batch a call
    if write and gone > 0 then
      call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
      dirty = true
    end
  end
  total = total - gone * cost
  if total < 0 then total = 0 end
end

local status, at, retry_after, denied_by = 1, now, 0, 0
local member = cost == 1 and token or token .. '.' .. cost
if total + cost > limit then
  -- full: as acquire.lua (reservations ahead of a paused key, a slot abandoned in the
  -- window: acquire_full.lua's; the pruned total written back first)
  local abandoned = string.format('(%.0f', now - exact)
  if (newest > now and gate > now)
    or call('ZCOUNT', pending, abandoned, floor(now - exact / 4)) > 0 then
    if write and dirty then call('ZADD', key, total, '') end
    return {8}
  end
  local nth = call('ZCOUNT', key, '-inf', string.format('%.0f', now - window))
    + math.ceil((total + cost - limit) / cost) - 1
  local row = call('ZRANGE', key, nth, nth, 'WITHSCORES')
  local free = row[2] and tonumber(row[2]) + window or now + window
  if newest > now then
    -- reservations ahead: the first fit among them (its functions made only here: each
    -- function a call creates costs Redis time)
--- @include "lib/fit.lua"
    free = fit_at(key, now, window, limit - cost, cost, counted_room, free)
  end
  if free > now then at, denied_by = free, 1 end  -- a hole before reservations ahead: now
end
if gate > at then at, denied_by = gate, 2 end
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

-- the call's entry at `at` (a reservation's slot too), as acquire.lua writes it
if write and status ~= 0 then
  if total > 0 and at > newest and at + window <= expiry then
    call('ZADD', key, at, member, total + cost, '', -at, '+')
  else
    local z = {at, member, total + cost, ''}
    if total == 0 then z[5], z[6] = cost, '=' end
    if at > newest then z[#z + 1], z[#z + 2] = -at, '+' end
    if at + window > expiry then
      local ttl = math.ceil((at + window - now) / 1000) + TTL_MARGIN_MS
      z[#z + 1], z[#z + 2] = -(now + ttl * 1000), '~'
      call('ZADD', key, unpack(z))
      call('PEXPIRE', key, ttl)
    else
      call('ZADD', key, unpack(z))
    end
  end
  if status == 2 then
    call('ZREMRANGEBYSCORE', pending, '-inf', now - window)
    call('ZADD', pending, at, member)
    local ttl = math.ceil((at + window - now) / 1000) + TTL_MARGIN_MS
    if call('PTTL', pending) < ttl then call('PEXPIRE', pending, ttl) end
  end
  total = total + cost
  if at > newest then newest = at end
elseif write and dirty then
  call('ZADD', key, total, '')
end
local remaining, reset = limit - total, 0
if remaining < 0 then remaining = 0 end
if total > 0 and newest + window - now > 0 then reset = newest + window - now end
return {status, remaining, retry_after, reset, denied_by, at}
