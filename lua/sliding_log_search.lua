-- sliding_log_search.lua — the searches for an instant, included by sliding_log.lua
-- at its "@include" line (celery_ratelimit/_scripts.py joins them into one script).
-- They read the including script's locals: now, hold, n, KEYS, ENTRY_FLOOR, TOKEN_LEN, and
-- each limit's table k (key, limit, window, exact, cost, member, total, unit).

-- The earliest instant from t0 at which k's cost fits every window around it,
-- counting what really started: entries later than t0 - exact (W + g / 2), less
-- the pending slots that have not started (due after t0) or were abandoned (overdue by
-- more than a quarter window), less this call's own entry. Pending slots due within
-- the last quarter window still count: their tasks are on their way. Starts held for
-- later than t0 count too, which only errs on the safe side. i: k's place in KEYS.
local function start_in(i, k, t0)
  local lo = t0 - k.exact
  local abandoned = math.floor(now - k.exact / 4)
  local log, pending, after = k.key, KEYS[n + i], '(' .. string.format('%.0f', lo)
  if k.unit > 0 then
    -- every entry weighs `unit`: counts and ranks, O(log n) each, find the answer
    local own = redis.call('ZSCORE', log, k.member)
    own = own and tonumber(own)
    local own_slot = redis.call('ZSCORE', pending, k.member)
    own_slot = own_slot and tonumber(own_slot)
    if own_slot and (own_slot <= abandoned or own_slot > t0) then own = nil end
    -- how many entries count in (lo, x]
    local function counted(x)
      local upto = x == math.huge and '+inf' or string.format('%.0f', x)
      local c = redis.call('ZCOUNT', log, after, upto)
      if abandoned > lo then
        c = c - redis.call('ZCOUNT', pending, after, x < abandoned and upto or abandoned)
      end
      if x > t0 then c = c - redis.call('ZCOUNT', pending, '(' .. string.format('%.0f', t0), upto) end
      if own and own > lo and own <= x then c = c - 1 end
      return c
    end
    local excess = counted(math.huge) * k.unit + k.cost - k.limit
    if excess <= 0 then return t0 end
    -- the entry whose leaving makes room: the j-th that counts, by a binary search
    -- over the log's ranks (meta members and older entries rank first)
    local j = math.ceil(excess / k.unit)
    local first = redis.call('ZCOUNT', log, '-inf', string.format('%.0f', lo))
    local last = redis.call('ZCARD', log) - 1
    while first < last do
      local mid = math.floor((first + last) / 2)
      if counted(tonumber(redis.call('ZRANGE', log, mid, mid, 'WITHSCORES')[2])) >= j then
        last = mid
      else
        first = mid + 1
      end
    end
    return tonumber(redis.call('ZRANGE', log, first, first, 'WITHSCORES')[2]) + k.exact
  end
  -- mixed weights: walk the entries, oldest first, up to the last that can have
  -- started: every entry later than now + hold is a reservation still pending (a
  -- start is placed at most `hold` ahead), so a backlog's reservations are not walked
  local skip = {[k.member] = true}
  local upto = string.format('%.0f', math.max(t0, now + hold))
  local slots = redis.call('ZRANGEBYSCORE', pending, after, upto, 'WITHSCORES')
  for j = 1, #slots, 2 do
    local s = tonumber(slots[j + 1])
    if s <= abandoned or s > t0 then skip[slots[j]] = true end
  end
  local rows = redis.call('ZRANGEBYSCORE', log, after, upto, 'WITHSCORES')
  local started = 0
  for j = 1, #rows, 2 do
    if not skip[rows[j]] then started = started + (#rows[j] > TOKEN_LEN and tonumber(string.sub(rows[j], TOKEN_LEN + 2)) or 1) end
  end
  local excess = started + k.cost - k.limit
  if excess > 0 then
    for j = 1, #rows, 2 do
      if not skip[rows[j]] then
        excess = excess - (#rows[j] > TOKEN_LEN and tonumber(string.sub(rows[j], TOKEN_LEN + 2)) or 1)
        if excess <= 0 then return tonumber(rows[j + 1]) + k.exact end
      end
    end
  end
  return t0
end

-- The earliest instant at which `excess` weight has left k's (placement) window:
-- found by rank when every entry weighs the same, else by walking from the oldest.
local function free_at(k, excess)
  if k.unit > 0 then
    -- every entry weighs `unit`: the ceil(excess / unit)-th entry of the window, by
    -- its rank (meta members and entries at or before the window's start rank first)
    local nth = redis.call('ZCOUNT', k.key, '-inf', string.format('%.0f', now - k.window))
      + math.ceil(excess / k.unit) - 1
    local row = redis.call('ZRANGE', k.key, nth, nth, 'WITHSCORES')
    -- (no such entry: the running total disagrees with the entries, as only a
    -- hand-edited key can; a whole window is always safe)
    return row[2] and tonumber(row[2]) + k.window or now + k.window
  end
  -- Mixed weights: walk the window's entries from whichever end is nearer the answer.
  -- From the oldest, until `excess` weight has passed; from the newest, until more
  -- than total - excess has (a backlog's reservations make excess large, and that walk
  -- covers only about a limit's weight).
  local floor = '(' .. string.format('%.0f', now - k.window)
  local newest = excess > k.total / 2
  local left = newest and k.total - excess or excess
  local offset, batch = 0, math.min(math.max(left, 1), 64)
  while true do
    local rows
    if newest then
      rows = redis.call('ZREVRANGEBYSCORE', k.key, '+inf', floor, 'WITHSCORES', 'LIMIT', offset, batch)
    else
      rows = redis.call('ZRANGEBYSCORE', k.key, floor, '+inf', 'WITHSCORES', 'LIMIT', offset, batch)
    end
    for j = 1, #rows, 2 do
      local w = #rows[j] > TOKEN_LEN and tonumber(string.sub(rows[j], TOKEN_LEN + 2)) or 1
      if newest then
        left = left - w
        if left < 0 then return tonumber(rows[j + 1]) + k.window end
      else
        left = left - w
        if left <= 0 then return tonumber(rows[j + 1]) + k.window end
      end
    end
    if #rows < 2 * batch then
      -- The running total disagrees with the entries (only a hand-edited key can
      -- do this): wait one whole window, which is always safe.
      return now + k.window
    end
    offset = offset + batch
    batch = math.min(batch * 2, 1024)
  end
end
