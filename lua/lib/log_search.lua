-- lib/log_search.lua — the two searches of the log (lib/log.lua) for an instant: where a
-- call's cost fits counting every entry (a reservation, a denial's retry_after), and
-- where it fits counting what really started (a start). Functions of a limit's state
-- table `k`.

-- The earliest instant at which `excess` weight has left k's (placement) window,
-- counting every entry. With one weight for all entries, the entry that must leave is
-- found by its rank; with mixed weights, by walking the window from whichever end is
-- nearer the answer (a backlog's reservations make `excess` large: from the newest,
-- the walk covers about a limit's weight).
local function log_free_at(k, excess, now)
  if k.unit > 0 then
    local nth = redis.call('ZCOUNT', k.key, '-inf', us(now - k.window)) + math.ceil(excess / k.unit) - 1
    local row = redis.call('ZRANGE', k.key, nth, nth, 'WITHSCORES')
    -- (no such entry: the total disagrees with the entries, as only a hand-edited key
    -- can; a whole window is always safe)
    return row[2] and tonumber(row[2]) + k.window or now + k.window
  end
  local floor = '(' .. us(now - k.window)
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
      left = left - weight_of(rows[j])
      if left < 0 or (left == 0 and not newest) then return tonumber(rows[j + 1]) + k.window end
    end
    if #rows < 2 * batch then return now + k.window end
    offset = offset + batch
    batch = math.min(batch * 2, 1024)
  end
end

-- The earliest instant from t0 at which k's cost fits every window around it,
-- counting what really started: entries later than t0 - exact, less the pending slots
-- that have not started (due after t0) or were abandoned (overdue by more than a
-- quarter window), less the call's own entry. Slots due in the last quarter window
-- still count: their tasks are on their way. Starts held for later than t0 count too,
-- which errs on the safe side.
local function log_start_in(k, t0, now, hold)
  local lo = t0 - k.exact
  local abandoned = math.floor(now - k.exact / 4)
  local after = '(' .. us(lo)
  if k.unit > 0 then
    local own = redis.call('ZSCORE', k.key, k.member)
    own = own and tonumber(own)
    local own_slot = redis.call('ZSCORE', k.pending, k.member)
    own_slot = own_slot and tonumber(own_slot)
    if own_slot and (own_slot <= abandoned or own_slot > t0) then own = nil end
    -- how many entries count in (lo, x]
    local function counted(x)
      local upto = x == math.huge and '+inf' or us(x)
      local n = redis.call('ZCOUNT', k.key, after, upto)
      if abandoned > lo then
        n = n - redis.call('ZCOUNT', k.pending, after, x < abandoned and upto or abandoned)
      end
      if x > t0 then n = n - redis.call('ZCOUNT', k.pending, '(' .. us(t0), upto) end
      if own and own > lo and own <= x then n = n - 1 end
      return n
    end
    local excess = counted(math.huge) * k.unit + k.cost - k.limit
    if excess <= 0 then return t0 end
    -- the entry whose leaving makes room: the j-th that counts. When every entry up to
    -- the j-th after lo counts (the usual case: no slot abandoned there, the call's own
    -- entry later), it is the j-th by rank; else a binary search over the ranks after
    -- it (meta members and older entries rank first)
    local j = math.ceil(excess / k.unit)
    local first = redis.call('ZCOUNT', k.key, '-inf', us(lo)) + j - 1
    local guess = tonumber(redis.call('ZRANGE', k.key, first, first, 'WITHSCORES')[2])
    if counted(guess) >= j then return guess + k.exact end
    first = first + 1
    local last = redis.call('ZCARD', k.key) - 1
    while first < last do
      local mid = math.floor((first + last) / 2)
      if counted(tonumber(redis.call('ZRANGE', k.key, mid, mid, 'WITHSCORES')[2])) >= j then
        last = mid
      else
        first = mid + 1
      end
    end
    return tonumber(redis.call('ZRANGE', k.key, first, first, 'WITHSCORES')[2]) + k.exact
  end
  -- mixed weights: walk the entries up to the last that can have started (a start is
  -- placed at most `hold` ahead), so a backlog's reservations are not walked
  local skip = {[k.member] = true}
  local upto = us(math.max(t0, now + hold))
  local slots = redis.call('ZRANGEBYSCORE', k.pending, after, upto, 'WITHSCORES')
  for j = 1, #slots, 2 do
    local s = tonumber(slots[j + 1])
    if s <= abandoned or s > t0 then skip[slots[j]] = true end
  end
  local rows = redis.call('ZRANGEBYSCORE', k.key, after, upto, 'WITHSCORES')
  local excess = k.cost - k.limit
  for j = 1, #rows, 2 do
    if not skip[rows[j]] then excess = excess + weight_of(rows[j]) end
  end
  if excess <= 0 then return t0 end
  for j = 1, #rows, 2 do
    if not skip[rows[j]] then
      excess = excess - weight_of(rows[j])
      if excess <= 0 then return tonumber(rows[j + 1]) + k.exact end
    end
  end
  return t0
end

-- Slots of k overdue by more than a quarter window and not started (a copy stuck
-- behind a flood of messages, or lost): their room may be taken by a call that fits
-- counting what started.
local function log_abandoned(k, now)
  return redis.call('ZCOUNT', k.pending, '(' .. us(now - k.exact), math.floor(now - k.exact / 4))
end
