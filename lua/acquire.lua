-- acquire.lua — the plain decision of a call with several limits (unpaced sliding logs,
-- no lead): count it now against all or none, or reserve it. One limit: acquire_one.lua.
-- What either leaves ({8}) is acquire_full.lua's (one model: test_limiter_properties.py).
-- KEYS  the log of each limit (n), its pending set (n), its key's settings hash (n)
-- ARGV  1 token (8 bytes), 2 flag, 3 n, 4-5 "0" "0", 6 horizon µs, 7 guard µs, 8 hold µs,
--       9 lead "0", then each limit's (limit, window µs, cost, burst "0"): lib/call.lua's
-- flag  "now": count it now or deny (status 1, 0); "reserve": else at the earliest
--       instant it fits within the horizon (status 2, its slot in the pending set; 6
--       within `hold`), else deny; "peek": as "now", writing nothing
-- Reply {status, remaining, retry_after, reset_after, denied_by, at} (lib/call.lua), or
--       {8}: acquire_full.lua's call (pace, lead, other weights, an observed upstream,
--       over PRUNE_BATCH expired, in a full window an abandoned slot or reservations
--       ahead of a pause or of several limits); only expired entries were removed

--- @include "lib/plain.lua"

local call, tonumber, floor = redis.call, tonumber, math.floor
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token, flag, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local write = flag ~= 'peek'
if #ARGV ~= 9 + 4 * n or ARGV[9] ~= '0' then return {8} end
local guard = tonumber(ARGV[7])

-- each limit: its key's settings (a pause holds the call; an override in force replaces
-- the limit of its window, or of any for the key's only limit), its log, whether it fits
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
  local l, w, u = string.match(s[2] or '', '^(%d+) (%d+) (%d+)$')
  if l and (tonumber(u) == 0 or tonumber(u) > now) then
    local alone = true
    for j = 1, n do alone = alone and (j == i or KEYS[2 * n + j] ~= hash) end
    if alone or tonumber(w) == window then limit, window = math.max(tonumber(l), cost), tonumber(w) end
  end
  local slack = guard
  if window / 25 < slack then slack = floor(window / 25) end
  local exact = window + floor(slack / 2)
  window = window + slack
  local key = KEYS[i]
  local total, newest, expiry, dirty = plain_open(key, cost, now, window, write)
  if not total then status = 8 break end
  ks[i] = {key, limit, window, total, newest, expiry, dirty, cost,
    cost == 1 and token or token .. '.' .. cost}
  if total + cost > limit then
    local free = plain_free(key, KEYS[n + i], now, window, exact, limit, cost, total, newest,
      n > 1 or gate > now)
    if not free then status = 8 break end
    if free > at then at, denied_by = free, i end
  end
end
local retry_after = 0
if status ~= 8 then
  if gate > at then at, denied_by = gate, n + 1 end
  if denied_by > 0 then
    status, at, retry_after = plain_denied(flag, at, now, tonumber(ARGV[6]), tonumber(ARGV[8]))
  end
end

-- the call's entry at `at` in each log (a reservation's slot too), or the pruned totals
local remaining, reset, counted = nil, 0, write and status ~= 0 and status ~= 8
for i = 1, #ks do
  local k = ks[i]
  local window, total, newest = k[WINDOW], k[TOTAL], k[NEWEST]
  if counted then
    total, newest = plain_write(k[KEY], KEYS[n + i], status, at, k[MEMBER], k[COST], total,
      newest, k[EXPIRY], window, now)
  elseif k[DIRTY] then
    call('ZADD', k[KEY], total, '')
  end
  if remaining == nil or k[LIMIT] - total < remaining then remaining = k[LIMIT] - total end
  if total > 0 and newest + window - now > reset then reset = newest + window - now end
end
if status == 8 then return {8} end
if remaining == nil or remaining < 0 then remaining = 0 end
return {status, remaining, retry_after, reset, denied_by, at}
