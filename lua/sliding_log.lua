-- sliding_log.lua — exact sliding-window log over one or more limits, all or nothing.
--
-- KEYS[i]   one sorted set per limit. An entry is one granted (or reserved) call:
--           member = the call's 8-byte token, followed by "." .. weight when the
--           weight is not 1; score = the entry's instant in microseconds on this
--           server's clock (later than now for a reservation). The member "" holds
--           the key's running total weight as its score, which stays below
--           ENTRY_FLOOR so that range scans over entries never see it.
-- ARGV[1]   token: 8 bytes, unique per call; the member this call writes
-- ARGV[2]   mode: 0 acquire now or deny
--                 1 acquire now, else reserve the earliest instant that fits
--                 2 peek: decide as mode 0 but write nothing
--                 3 confirm the reservation held by ARGV[1]; acts as mode 1 if it is gone
--                 4 release the reservation held by ARGV[1] (if still in the future)
-- ARGV[3]   horizon, microseconds: no reservation is made further ahead than this
-- ARGV[1+3i], ARGV[2+3i], ARGV[3+3i]   for KEYS[i]: limit (weight units), window
--           (microseconds) and this call's cost there (integer, 1 <= cost <= limit)
--
-- Reply: {status, remaining, retry_after, reset_after, denied_by, at}
--   status       0 denied, 1 allowed now, 2 reserved for `at`,
--                3 the reservation is held but not yet due (retry_after = at - now),
--                4 released (or nothing to release)
--   remaining    weight still free in the tightest limit, counting reservations
--   retry_after  microseconds until this cost fits every limit (0 when allowed)
--   reset_after  microseconds until every limit of the call is back to full
--   denied_by    1-based index of the limit that set retry_after, 0 if none
--   at           server time of the decision, or the reserved instant, microseconds
--
-- Invariant: in every window (t - W, t] the weight of entries, reservations
-- included, is at most the limit. A call may be placed at s only if
-- g(s) + cost <= limit (for every key), where g(s) is the weight of all entries later than s - W:
-- every window that contains s lies inside (s - W, +inf), and g never grows with
-- s, so the earliest such s is found by walking entries from the oldest until
-- enough weight has left. retry_after is exact: it is that walk's answer.

local ENTRY_FLOOR = 1e13
local TOKEN_LEN = 8
local TTL_MARGIN_MS = 1000

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token = ARGV[1]
local mode = tonumber(ARGV[2])
local horizon = tonumber(ARGV[3])
local n = #KEYS

local function weight(m)
  if #m > TOKEN_LEN then
    return tonumber(string.sub(m, TOKEN_LEN + 2))
  end
  return 1
end

local function num(x)
  return string.format('%.0f', x)
end

-- Prune expired entries and read each key's total weight.
local limits, windows, costs, members, totals = {}, {}, {}, {}, {}
for i = 1, n do
  local key = KEYS[i]
  local window = tonumber(ARGV[2 + 3 * i])
  limits[i] = tonumber(ARGV[1 + 3 * i])
  windows[i] = window
  local cost = tonumber(ARGV[3 + 3 * i])
  costs[i] = cost
  if cost == 1 then members[i] = token else members[i] = token .. '.' .. cost end
  local s = redis.call('ZSCORE', key, '')
  local total = s and tonumber(s) or 0
  local cutoff = num(now - window)
  local old = redis.call('ZRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
  if #old > 0 then
    for j = 1, #old do
      total = total - weight(old[j])
    end
    if total < 0 then total = 0 end
    if mode ~= 2 then
      redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
      redis.call('ZADD', key, total, '')
    end
  end
  totals[i] = total
end

local lasts = {}
local function newest(i)
  if lasts[i] then return lasts[i] end
  local top = redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')
  local score = top[2] and tonumber(top[2]) or 0
  if score < ENTRY_FLOOR then score = 0 end
  lasts[i] = score
  return score
end

local function summary(status, at, retry_after, denied_by)
  local remaining, reset = nil, 0
  for i = 1, n do
    local free = limits[i] - totals[i]
    if remaining == nil or free < remaining then remaining = free end
    local last = newest(i)
    if last > 0 then
      local r = last + windows[i] - now
      if r > reset then reset = r end
    end
  end
  if remaining < 0 then remaining = 0 end
  return {status, remaining, retry_after, reset, denied_by, at}
end

-- Remove this call's entry from every key (used by release and stale reservations).
local function remove_entry(only_future)
  for i = 1, n do
    local s = redis.call('ZSCORE', KEYS[i], members[i])
    if s and (not only_future or tonumber(s) > now) then
      redis.call('ZREM', KEYS[i], members[i])
      totals[i] = totals[i] - costs[i]
      if totals[i] < 0 then totals[i] = 0 end
      redis.call('ZADD', KEYS[i], totals[i], '')
    end
  end
end

if mode == 3 or mode == 4 then
  local at, held = nil, true
  for i = 1, n do
    local s = redis.call('ZSCORE', KEYS[i], members[i])
    if not s or tonumber(s) <= now - windows[i] then
      held = false
    else
      at = tonumber(s)
    end
  end
  if mode == 4 then
    remove_entry(true)
    return summary(4, now, 0, 0)
  end
  if held then
    if at > now then
      return summary(3, at, at - now, 0)
    end
    return summary(1, at, 0, 0)
  end
  -- Lost (server restarted, key reset, slot long past): compete again as mode 1.
  remove_entry(false)
  mode = 1
end

-- The earliest instant at which `excess` weight has left key i's window.
local function free_at(i, excess)
  local offset, batch = 0, math.min(excess, 64)
  local floor = '(' .. num(now - windows[i])
  while true do
    local rows = redis.call('ZRANGEBYSCORE', KEYS[i], floor, '+inf', 'WITHSCORES', 'LIMIT', offset, batch)
    for j = 1, #rows, 2 do
      excess = excess - weight(rows[j])
      if excess <= 0 then
        return tonumber(rows[j + 1]) + windows[i]
      end
    end
    if #rows < 2 * batch then
      -- The running total disagrees with the entries (only a hand-edited key can
      -- do this): wait one whole window, which is always safe.
      return now + windows[i]
    end
    offset = offset + batch
    batch = math.min(batch * 2, 1024)
  end
end

local at, denied_by = now, 0
for i = 1, n do
  local excess = totals[i] + costs[i] - limits[i]
  if excess > 0 then
    local s = free_at(i, excess)
    if s > at then
      at, denied_by = s, i
    end
  end
end

if mode == 2 then
  if denied_by == 0 then
    return summary(1, now, 0, 0)
  end
  return summary(0, now, at - now, denied_by)
end

local status = 1
if denied_by ~= 0 then
  if mode ~= 1 or at - now > horizon then
    return summary(0, now, at - now, denied_by)
  end
  status = 2
end

for i = 1, n do
  local key = KEYS[i]
  local last = newest(i)
  totals[i] = totals[i] + costs[i]
  redis.call('ZADD', key, at, members[i], totals[i], '')
  if at > last then
    redis.call('PEXPIRE', key, math.ceil((at + windows[i] - now) / 1000) + TTL_MARGIN_MS)
    lasts[i] = at
  end
end
return summary(status, at, at - now, denied_by)
