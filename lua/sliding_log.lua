-- sliding_log.lua — exact sliding-window log over one or more limits, all or nothing.
--
-- KEYS[i]   one sorted set per limit. An entry is one granted (or reserved) call:
--           member = the call's 8-byte token, followed by "." .. weight when the
--           weight is not 1; score = the entry's instant in microseconds on this
--           server's clock (later than now for a reservation). Meta members score
--           below ENTRY_FLOOR, so range scans over entries never see them; one
--           ZMSCORE reads them all and the entry's ZADD writes them:
--             ""  the key's running total weight
--             "+" minus the newest entry's instant
--             "=" the weight every entry has, or 0 once weights are mixed: while it
--                 is uniform, pruning needs only ZREMRANGEBYSCORE's count
--             "~" minus the instant the key's PEXPIRE runs out; PEXPIRE is sent
--                 again only when a new entry outlives it
-- KEYS[n+i] the pending set of limit i: the reservations whose task has not started
--           yet (same member, score = its slot). A start is checked against what
--           really started: the log's entries minus the pending ones. n = #KEYS / 2.
-- ARGV[1]   token: 8 bytes, unique per call; the member this call writes
-- ARGV[2]   the numbers, packed as little-endian doubles (struct '<d', exact for
--           integers below 2^53; one argument is much cheaper for a client to send, and
--           for this script to read, than a dozen):
--   1       mode: 0 acquire now or deny
--                 1 acquire now, else reserve the earliest instant that fits
--                 2 peek: decide as mode 0 but write nothing
--                 3 start the task that holds the reservation ARGV[1] (see below)
--                 4 release the reservation held by ARGV[1] (if still in the future)
--   2       horizon, microseconds: no reservation is made further ahead than this
--   3       guard, microseconds: every window W is placed as W + g, g = min(guard,
--           W / 50), while a confirmed reservation starts as soon as its cost fits
--           W + g / 4 (a body starts a moment after its check); the difference absorbs
--           tasks that start a little after their slot
--   1+3i, 2+3i, 3+3i   for KEYS[i]: limit (weight units), window (microseconds) and
--           this call's cost there (1 <= cost <= limit)
--
-- Reply: {status, remaining, retry_after, reset_after, denied_by, at}, integers:
--   status       0 denied, 1 allowed now, 2 reserved for `at`,
--                3 the reservation is held but not yet due (retry_after = at - now),
--                4 released (or nothing to release),
--                5 (mode 3) a task already started on this reservation: acquire anew
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
--
-- Starting a reserved task (mode 3). Not before its slot (status 3 until then). At or
-- after it, the task starts now if its cost fits the window (now - W, now] counting
-- what really started there (immediate grants and started reservations) and the
-- slots that came due in the last quarter window (their tasks are on their way);
-- slots overdue by more are abandoned, not counted. Its entry then moves to now.
-- Otherwise it holds the earliest instant at which it fits (status 3).
-- A late task thus never bunches with the next ones, and a reservation lost to a
-- restart or to lateness longer than the window still starts as soon as it fits,
-- instead of going to the back of the queue, so an overloaded pool keeps draining.

local ENTRY_FLOOR = 1e13
local TOKEN_LEN = 8
local TTL_MARGIN_MS = 1000

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token = ARGV[1]
local n = #KEYS / 2
local numbers = {struct.unpack('<' .. string.rep('d', 3 + 3 * n), ARGV[2])}
local mode, horizon, guard = numbers[1], numbers[2], numbers[3]

local function weight(m)
  if #m > TOKEN_LEN then
    return tonumber(string.sub(m, TOKEN_LEN + 2))
  end
  return 1
end

local function num(x)
  return string.format('%.0f', x)
end

local function put(list, score, member)
  list[#list + 1] = score
  list[#list + 1] = member
end

-- The newest entry of key i, read from the entries themselves (a key written before
-- "+" existed, or after a release removed the newest entry); 0 if there is none.
local function scan_newest(i)
  local top = redis.call('ZREVRANGEBYSCORE', KEYS[i], '+inf', ENTRY_FLOOR, 'WITHSCORES', 'LIMIT', 0, 1)
  return top[2] and tonumber(top[2]) or 0
end

-- Read each key's meta members; prune expired entries (not when peeking).
-- dirty[i]: the total stored in Redis is stale and must be written back.
local limits, windows, exact, costs, members, totals, newest, units, expiry, dirty =
  {}, {}, {}, {}, {}, {}, {}, {}, {}, {}
for i = 1, n do
  local key = KEYS[i]
  local plain = numbers[2 + 3 * i]
  local slack = math.min(guard, math.floor(plain / 25))
  local window = plain + slack
  limits[i] = numbers[1 + 3 * i]
  -- a start is checked in a window a quarter of the guard wider than W: a task body
  -- begins a moment after its check, by a varying moment
  windows[i], exact[i] = window, plain + math.floor(slack / 4)
  local cost = numbers[3 + 3 * i]
  costs[i] = cost
  if cost == 1 then members[i] = token else members[i] = token .. '.' .. cost end
  local meta = redis.call('ZMSCORE', key, '', '+', '=', '~')
  local total = meta[1] and tonumber(meta[1]) or 0
  local last, unit = 0, meta[3] and tonumber(meta[3]) or 0
  expiry[i] = meta[4] and -tonumber(meta[4]) or 0
  if total > 0 then
    last = meta[2] and -tonumber(meta[2]) or scan_newest(i)
    local cutoff = now - window
    if last <= cutoff then
      -- the whole log has left the window
      if mode ~= 2 then redis.call('DEL', key) end
      total, last, expiry[i] = 0, 0, 0
    elseif unit > 0 then
      local gone
      if mode ~= 2 then
        gone = redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, num(cutoff))
        if gone > 0 then dirty[i] = true end
      else
        gone = redis.call('ZCOUNT', key, ENTRY_FLOOR, num(cutoff))
      end
      total = total - gone * unit
    else
      local old = redis.call('ZRANGEBYSCORE', key, ENTRY_FLOOR, num(cutoff))
      if #old > 0 then
        for j = 1, #old do
          total = total - weight(old[j])
        end
        if mode ~= 2 then
          redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, num(cutoff))
          dirty[i] = true
        end
      end
    end
    if total < 0 then total = 0 end
  end
  totals[i], newest[i], units[i] = total, last, unit
end

local function summary(status, at, retry_after, denied_by)
  local remaining, reset = nil, 0
  for i = 1, n do
    local free = limits[i] - totals[i]
    if remaining == nil or free < remaining then remaining = free end
    if totals[i] > 0 then
      local r = newest[i] + windows[i] - now
      if r > reset then reset = r end
    end
  end
  if remaining < 0 then remaining = 0 end
  return {status, remaining, retry_after, reset, denied_by, at}
end

-- Write back the totals that pruning changed (a denial writes no entry).
local function flush()
  for i = 1, n do
    if dirty[i] then redis.call('ZADD', KEYS[i], totals[i], '') end
  end
end

-- Remove this call's entry from every key (used by release).
local function remove_entry(only_future)
  for i = 1, n do
    redis.call('ZREM', KEYS[n + i], members[i])
    local s = redis.call('ZSCORE', KEYS[i], members[i])
    if s and (not only_future or tonumber(s) > now) then
      redis.call('ZREM', KEYS[i], members[i])
      totals[i] = totals[i] - costs[i]
      if totals[i] < 0 then totals[i] = 0 end
      if tonumber(s) >= newest[i] then newest[i] = scan_newest(i) end
      redis.call('ZADD', KEYS[i], totals[i], '', -newest[i], '+')
      dirty[i] = nil
    end
  end
end

-- The earliest instant at which `excess` weight has left key i's (placement) window,
-- walking its entries from the oldest.
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

-- Keep key i's expiry and newest-entry meta in step with an entry placed at t.
local function extend(i, t, write)
  if t > newest[i] then
    newest[i] = t
    put(write, -t, '+')
  end
  if t + windows[i] > expiry[i] then
    local ttl = math.ceil((t + windows[i] - now) / 1000) + TTL_MARGIN_MS
    put(write, -(now + ttl * 1000), '~')
    redis.call('ZADD', KEYS[i], unpack(write))
    redis.call('PEXPIRE', KEYS[i], ttl)
  else
    redis.call('ZADD', KEYS[i], unpack(write))
  end
end

-- Add this call's entry at t to key i: its weight joins the running total (and the
-- uniform-weight meta), in the entry's own ZADD.
local function add(i, t)
  local cost = costs[i]
  local write = {t, members[i], totals[i] + cost, ''}
  if totals[i] == 0 then
    put(write, cost, '=')
  elseif units[i] ~= 0 and units[i] ~= cost then
    put(write, 0, '=')
  end
  totals[i] = totals[i] + cost
  dirty[i] = nil
  extend(i, t, write)
end

-- Put this call's entry at t in key i: moved if it is there, else added.
local function place(i, t)
  if not redis.call('ZSCORE', KEYS[i], members[i]) then
    return add(i, t)
  end
  local write = {t, members[i]}
  if dirty[i] then
    put(write, totals[i], '')
    dirty[i] = nil
  end
  extend(i, t, write)
end

-- Keep the pending entry of key i at t (or drop it: t == nil), pruning slots whose
-- window has passed.
local function pend(i, t)
  local key = KEYS[n + i]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', num(now - windows[i]))
  if t == nil then
    redis.call('ZREM', key, members[i])
  else
    redis.call('ZADD', key, t, members[i])
    -- only ever extend: the set also holds slots further ahead than this one
    local ttl = math.ceil((t + windows[i] - now) / 1000) + TTL_MARGIN_MS
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
end

if mode == 4 then
  remove_entry(true)
  flush()
  return summary(4, now, 0, 0)
end

if mode == 3 then
  local slot = redis.call('ZSCORE', KEYS[n + 1], members[1])
  slot = slot and tonumber(slot)
  if slot and slot > now then
    flush()
    return summary(3, slot, slot - now, 0)
  end
  if not slot then
    local used = redis.call('ZSCORE', KEYS[1], members[1])
    if used and tonumber(used) <= now then
      -- a task already started on this reservation: this is a second execution (a
      -- message delivered again), which needs budget of its own
      flush()
      return summary(5, now, 0, 0)
    end
  end
  -- Due, late or lost: count what really started in (now - W, now].
  local start = now
  for i = 1, n do
    local lo, hi = '(' .. num(now - exact[i]), num(now)
    -- slots due within the last quarter window still count (their tasks are on
    -- their way); slots overdue by more were abandoned: their tasks compete anew
    local pending = redis.call('ZRANGEBYSCORE', KEYS[n + i], lo, num(now - exact[i] / 4))
    local skip = {[members[i]] = true}
    for j = 1, #pending do skip[pending[j]] = true end
    local rows = redis.call('ZRANGEBYSCORE', KEYS[i], lo, hi, 'WITHSCORES')
    local started = 0
    for j = 1, #rows, 2 do
      if not skip[rows[j]] then started = started + weight(rows[j]) end
    end
    local excess = started + costs[i] - limits[i]
    if excess > 0 then
      for j = 1, #rows, 2 do
        if not skip[rows[j]] then
          excess = excess - weight(rows[j])
          if excess <= 0 then
            local s = tonumber(rows[j + 1]) + exact[i]
            if s > start then start = s end
            break
          end
        end
      end
    end
  end
  for i = 1, n do
    place(i, start)
    if start > now then pend(i, start) else pend(i, nil) end
  end
  if start > now then
    return summary(3, start, start - now, 0)
  end
  return summary(1, now, 0, 0)
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
    flush()
    return summary(0, now, at - now, denied_by)
  end
  status = 2
end

for i = 1, n do
  add(i, at)
  if status == 2 then pend(i, at) end
end
return summary(status, at, at - now, denied_by)
