-- acquire_one.lua — the plain decision of a call with one limit: acquire.lua's without
-- its walk over several limits. What it leaves ({8}) is acquire_full.lua's.
-- KEYS  1 the limit's log, 2 its pending set, 3 its key's settings hash
-- ARGV  acquire.lua's for one limit: 1 token (8 bytes), 2 flag, 3 "1", 4-5 "0" "0",
--       6 horizon µs, 7 guard µs, 8 hold µs, 9 lead "0", 10 limit, 11 window µs,
--       12 cost, 13 burst "0"
-- flag  "now", "reserve" or "peek", as acquire.lua's
-- Reply {status, remaining, retry_after, reset_after, denied_by, at}, or {8}, as
--       acquire.lua's

--- @include "lib/plain.lua"

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

-- the log opened and pruned, then whether the call fits (lib/plain.lua)
local total, newest, expiry, dirty = plain_open(key, cost, now, window, write)
if not total then return {8} end
local status, at, retry_after, denied_by = 1, now, 0, 0
if total + cost > limit then
  local free = plain_free(key, pending, now, window, exact, limit, cost, total, newest, gate > now)
  if not free then
    if dirty then call('ZADD', key, total, '') end  -- the pruned total written back
    return {8}
  end
  if free > now then at, denied_by = free, 1 end
end
if gate > at then at, denied_by = gate, 2 end
if denied_by > 0 then
  status, at, retry_after = plain_denied(flag, at, now, tonumber(ARGV[6]), tonumber(ARGV[8]))
end

-- the call's entry at `at` (a reservation's slot too), or the pruned total written back
if write and status ~= 0 then
  total, newest = plain_write(key, pending, status, at,
    cost == 1 and token or token .. '.' .. cost, cost, total, newest, expiry, window, now)
elseif dirty then
  call('ZADD', key, total, '')
end
local remaining, reset = limit - total, 0
if remaining < 0 then remaining = 0 end
if total > 0 and newest + window - now > 0 then reset = newest + window - now end
return {status, remaining, retry_after, reset, denied_by, at}
