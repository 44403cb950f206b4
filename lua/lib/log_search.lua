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

--- @include "lib/fit.lua"

-- nil if the window ending at p holds at most `cap` in weight, else the instant it would
local function weighed_room(key, p, w, cap)
  local rows = redis.call('ZRANGEBYSCORE', key, '(' .. us(p - w), us(p), 'WITHSCORES')
  local held = 0
  for j = 1, #rows, 2 do held = held + weight_of(rows[j]) end
  if held <= cap then return nil end
  for j = 1, #rows, 2 do
    held = held - weight_of(rows[j])
    if held <= cap then return tonumber(rows[j + 1]) + w end
  end
end

-- The earliest instant from `from` (not before now) at which k's cost fits every window
-- containing it, counting every entry (lib/fit.lua): a reservation's place, a denial's
-- retry_after. A line of reservations with holes in it (a released slot, a start placed
-- elsewhere, a stretch before a line far ahead) has its earliest hole taken, not a
-- place after its last entry. With no entry later than `from`, the heaviest window
-- holding s is the one ending at s, and log_free_at's answer is the first fit.
local function log_fit_at(k, from, now)
  local excess = k.total + k.cost - k.limit
  if excess <= 0 then return from end
  local last = log_free_at(k, excess, now)  -- every instant from it fits
  if last <= from or k.newest <= from then return math.max(last, from) end
  local room = k.unit > 0 and counted_room or weighed_room
  return fit_at(k.key, from, k.window, k.limit - k.cost, k.unit, room, last)
end

-- The earliest instant from `at` (set by limit `by`, lib/call.lua's denied_by) at which
-- the call fits every log of `ks` counting every entry (log_fit_at), the pace of each,
-- and `push` (nil, or a function of (at, by) giving the instant some other limit moves
-- it to: aligned limits, a paced start's window); and the limit that moved it last.
-- Each is asked in turn until none moves it. Should they keep moving it (holes in one
-- log that the entries of another fill), the instant from which every log fits counting
-- all its later entries is taken: there they all fit.
local function logs_place(ks, at, by, now, push)
  local n = #ks + (push and 1 or 0)
  local fits, asked, i = 0, 0, 0
  while fits < n and asked < 4 * n do
    i, asked = i % n + 1, asked + 1
    local s, b
    if i > #ks then
      s, b = push(at, by)
    else
      local k = ks[i]
      s, b = log_fit_at(k, pace_at(k.pace, k.cost, at), now), i
    end
    if s > at then at, by, fits = s, b, 1 else fits = fits + 1 end
  end
  if fits < n then
    for j, k in ipairs(ks) do
      local excess = k.total + k.cost - k.limit
      local s = pace_at(k.pace, k.cost, excess > 0 and log_free_at(k, excess, now) or now)
      if s > at then at, by = s, j end
    end
    if push then at, by = push(at, by) end
  end
  return at, by
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
