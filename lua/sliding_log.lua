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
--           really started: the log's entries minus the pending ones.
-- then      the call's calendar-aligned limits' keys (calendar.lua), its concurrency
--           limits' keys (3 each) and its keys' settings hashes (see gate.lua):
--           n = (#KEYS - na - 3 * nc - ns) / 2 sliding rate limits.
-- ARGV[1]   token: 8 bytes, unique per call; the member this call writes
-- ARGV[2]   the numbers, packed as little-endian doubles (struct '<d', exact for
--           integers below 2^53; one argument is much cheaper for a client to send, and
--           for this script to read, than a dozen):
--   1       mode: 0 acquire now or deny
--                 1 acquire now, else reserve the earliest instant that fits
--                 2 peek: decide as mode 0 but write nothing
--                 3 start the task that holds the reservation ARGV[1] (see below)
--                 4 release the reservation held by ARGV[1] (if still in the future)
--                 5 restamp: the task granted as ARGV[1] starts only now (its grant's
--                   reply was read late): start it as mode 3 starts a late task
--                 9 settle: the call ARGV[1], counted at the weights packed after
--                   every other number (one per rate limit), now weighs its cost
--                   (0 or more, may exceed the limit)
--   2       horizon, microseconds: no reservation is made further ahead than this
--   3       guard, microseconds: every window W is placed as W + g, g = min(guard,
--           W / 25), while a confirmed reservation starts as soon as its cost fits
--           W + g / 2 (a body starts a moment after its check, by a varying moment:
--           up to g / 2 of variation is absorbed); the difference absorbs tasks that
--           start a little after their slot
--   4       hold, microseconds: a start (mode 1, 3 or 5) due no further ahead than this
--           is recorded as started at that instant (status 6): the caller waits for
--           it in-process and runs without a second call. 0: never
--   5, 6, 7 nc, ns, na: how many concurrency limits, settings hashes (gate.lua) and
--           calendar-aligned limits (calendar.lua)
--   5+3i, 6+3i, 7+3i   for KEYS[i]: limit (weight units), window (microseconds) and
--           this call's cost there (1 <= cost <= limit); then the same three of each
--           aligned limit, gate.lua's numbers, and calendar.lua's boundaries
-- Modes 6 (renew) and 7 (pause) are gate.lua's. A paused key or a full concurrency
-- limit holds a call back as a later instant would: it starts, or is placed, no
-- sooner than gate.lua's `gate`; a start held back by a concurrency limit is
-- confirmed again (status 2 or 3, never 6).
--
-- Reply: {status, remaining, retry_after, reset_after, denied_by, at}, integers,
-- or, for an acquisition (mode 0 or 1) that fits its one limit now, only
-- {remaining, reset_after, at}: status 1, retry_after 0, denied_by 0 (the most
-- frequent answer, kept short: a table's conversion to a reply is about 1 us):
--   status       0 denied, 1 allowed now, 2 reserved for `at`,
--                3 the reservation is held but not yet due (retry_after = at - now);
--                  for mode 5, the late grant became that reservation
--                4 released (or nothing to release),
--                5 (mode 3) a task already started on this reservation: acquire anew
--                6 started at `at`, within `hold` from now (retry_after = at - now):
--                  run then, without confirming
--                7 (mode 9) settled (0: no entry of the call was found)
--   remaining    weight still free in the tightest limit, counting reservations
--   retry_after  microseconds until this cost fits every limit (0 when allowed)
--   reset_after  microseconds until every limit of the call is back to full
--   denied_by    1-based index of the limit that set retry_after (rate limits, then
--                concurrency limits; one more than both: a pause), 0 if none
--   at           server time of the decision, or the reserved instant, microseconds
--
-- Invariant: in every window (t - W, t] the weight of the entries that count, at most
-- the limit: what started, and reservations, less those abandoned (see mode 3: a
-- slot overdue by more than a quarter window, whose room a start may take; its task,
-- if it comes, starts where its cost fits among what started). A call is placed at s if
-- g(s) + cost <= limit (for every key), where g(s) is the weight of all entries later than s - W:
-- every window that contains s lies inside (s - W, +inf), and g never grows with
-- s, so the earliest such s is found by walking entries from the oldest until
-- enough weight has left. retry_after is exact: it is that walk's answer. (Or now, if
-- a slot in the window was abandoned and the cost fits among what started.)
--
-- Starting a reserved task (mode 3). Not before its slot (status 3 until then, or
-- status 6 for a slot within `hold`). From t0 = max(now, slot), the task starts at
-- the earliest instant its cost fits every window counting what really started (immediate
-- grants, started reservations, starts held for a later instant) and the slots that
-- came due in the last quarter window (their tasks are on their way); slots overdue
-- by more are abandoned, not counted. Its entry moves to that instant: now (status 1)
-- or within `hold` (status 6), when that is at most `hold` / 4 past t0. A late task
-- thus never bunches with the next ones, and an overdue one (a copy stuck behind a
-- flood of messages, lost to a restart) starts ahead of the slots still to come when
-- their room is free. Otherwise (status 3) the entry moves where a new reservation
-- would go, counting every entry: taking the next room that started tasks leave would
-- push the task due there, and that one the next, a chain of deferrals through the
-- whole backlog (measured: 7 per task for a backlog of 50 windows); waiting longer
-- in-process would make every task after a late one wait as long.
--
-- Restamping a late grant (mode 5). A grant is an entry at the instant Redis decided;
-- a worker that reads the reply late (a busy gevent hub, a descheduled process) would
-- start the body later than its entry says and could bunch it with the next window's
-- starts. It sends mode 5 instead: its entry (wherever it is, or a new one if it has
-- left the log) is started from t0 = now exactly as a late reservation is above.

local ENTRY_FLOOR = 1e13
local TOKEN_LEN = 8
local TTL_MARGIN_MS = 1000
-- At most this many expired entries are removed per call once a log holds more (the
-- rest on later calls): a burst of 100,000 entries leaving at once took 20-50 ms of
-- Redis time in one call, a batch of 500 takes about 0.4 ms.
local PRUNE_BATCH = 500
-- (an entry's weight: #m > TOKEN_LEN and tonumber(string.sub(m, TOKEN_LEN + 2)) or 1,
-- written out where needed: a helper function would be created on every call)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token = ARGV[1]
local mode, horizon, guard, hold, nc, ns, na = struct.unpack('<ddddddd', ARGV[2])
local n = (#KEYS - na - 3 * nc - ns) / 2
local limit1, plain1, cost1 = struct.unpack('<ddd', ARGV[2], 57)
-- the numbers of limits 2..n in a table, only when there are more (one table costs
-- about 1 us, a tenth of a single-limit decision)
local v = n > 1 and {struct.unpack('<' .. string.rep('d', 3 * n), ARGV[2], 57)} or nil
local nlimits, cbase, sbase, coff = n + na, 2 * n + na, 2 * n + na + 3 * nc, 57 + 24 * (n + na)
local abase, aidx, aoff, boff = 2 * n, n, 57 + 24 * n, coff + 16 * nc

--- @include "gate.lua"
--- @include "calendar.lua"
local simple = nc == 0 and na == 0 and gate == now

-- One table per limit: its key and numbers, and what its meta members say once
-- expired entries are pruned (not when peeking). total: the weight in the window;
-- stale: the weight of expired entries still stored (a long log is pruned a batch at
-- a time); the meta "" stores their sum. dirty: that sum must be written back.
local ks = {}
for i = 1, n do
  local key, limit, plain, cost = KEYS[i], limit1, plain1, cost1
  if i > 1 then limit, plain, cost = v[3 * i - 2], v[3 * i - 1], v[3 * i] end
  limit, plain = rated(i, limit, plain, cost)
  local slack = math.min(guard, math.floor(plain / 25))
  local meta = redis.call('ZMSCORE', key, '', '+', '=', '~')
  local total = meta[1] and tonumber(meta[1]) or 0
  local last, unit = 0, meta[3] and tonumber(meta[3]) or 0
  local expiry = meta[4] and -tonumber(meta[4]) or 0
  local window, dirty, stale = plain + slack, false, 0
  if total > 0 then
    if meta[2] then
      last = -tonumber(meta[2])
    else
      -- a key written before "+" existed: read the newest entry itself
      local top = redis.call('ZREVRANGEBYSCORE', key, '+inf', ENTRY_FLOOR, 'WITHSCORES', 'LIMIT', 0, 1)
      last = top[2] and tonumber(top[2]) or 0
    end
    local cutoff = now - window
    if last <= cutoff and (unit == 0 or total <= PRUNE_BATCH * unit) then
      -- the whole log has left the window
      if mode ~= 2 then redis.call('DEL', key) end
      total, last, expiry = 0, 0, 0
    elseif unit > 0 then
      local gone
      if mode == 2 then
        gone = redis.call('ZCOUNT', key, ENTRY_FLOOR, cutoff)
      elseif total <= PRUNE_BATCH * unit then
        gone = redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
        dirty = gone > 0
      else
        -- a long log: its oldest PRUNE_BATCH expired entries go (up to the score of
        -- the last of them, by rank), the rest stay stored as `stale` weight
        gone = redis.call('ZCOUNT', key, ENTRY_FLOOR, cutoff)
        local upto = cutoff
        if gone > PRUNE_BATCH then
          local edge = redis.call('ZCOUNT', key, '-inf', '(' .. ENTRY_FLOOR) + PRUNE_BATCH - 1
          upto = redis.call('ZRANGE', key, edge, edge, 'WITHSCORES')[2]
        end
        if gone > 0 then
          stale = (gone - redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, upto)) * unit
          dirty = true
        end
      end
      total = total - gone * unit
    else
      local old = redis.call('ZRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
      if #old > 0 then
        for j = 1, #old do
          total = total - (#old[j] > TOKEN_LEN and tonumber(string.sub(old[j], TOKEN_LEN + 2)) or 1)
        end
        if mode ~= 2 then
          redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
          dirty = true
        end
      end
    end
    if total < 0 then total = 0 end
  end
  if simple and n == 1 and mode <= 1 and total + cost <= limit then
    -- The common case, written out: one limit, and the call fits now. No per-limit
    -- table and no helper function (each costs ~0.3-0.9 us of a ~14 us decision);
    -- the same entry and meta as add() and extend() below write.
    local member = cost == 1 and token or token .. '.' .. cost
    if total > 0 and now > last and now + window <= expiry and (unit == 0 or unit == cost) then
      -- and the most common: the entry, the new total and the newest instant are all
      -- that change, in one ZADD of its arguments (no table to build and unpack)
      redis.call('ZADD', key, now, member, total + stale + cost, '', -now, '+')
      return {limit - total - cost, window, now}
    end
    local write = {now, member, total + stale + cost, ''}
    if total + stale == 0 then
      write[5], write[6] = cost, '='
    elseif unit ~= 0 and unit ~= cost then
      write[5], write[6] = 0, '='
    end
    if now > last then
      last = now
      write[#write + 1] = -now
      write[#write + 1] = '+'
    end
    if now + window > expiry then
      local ttl = math.ceil(window / 1000) + TTL_MARGIN_MS
      write[#write + 1] = -(now + ttl * 1000)
      write[#write + 1] = '~'
      redis.call('ZADD', key, unpack(write))
      redis.call('PEXPIRE', key, ttl)
    else
      redis.call('ZADD', key, unpack(write))
    end
    return {limit - total - cost, last + window - now, now}
  end
  -- a start is checked in a window (exact) half the guard wider than W: a task
  -- body begins a moment after its check (or its held instant), by a varying moment
  ks[i] = {key = key, limit = limit, window = window,
    exact = plain + math.floor(slack / 2), cost = cost,
    member = cost == 1 and token or token .. '.' .. cost, dirty = dirty,
    total = total, stale = stale, newest = last, unit = unit, expiry = expiry}
end

-- The two searches for an instant: start_in (counting what started) and free_at
-- (counting every entry), in a file of their own.
--- @include "sliding_log_search.lua"

--- @include "sliding_log_write.lua"

if mode == 9 then
  -- settle: the call's entry, counted at weight `was`, now weighs its cost (a
  -- refund frees budget at once; a surcharge may put the window over its limit, which
  -- the next calls wait out). Its instant stays; an entry that has left the window,
  -- or was never written, is left alone.
  local was = {struct.unpack('<' .. string.rep('d', n + na), ARGV[2], boff + 48 * na)}
  local found = cal_settle(was)
  for i = 1, n do
    local k, w = ks[i], was[i]
    local old = w == 1 and token or token .. '.' .. w
    local s = redis.call('ZSCORE', k.key, old)
    if s and tonumber(s) > now - k.window then
      found = found + 1
      redis.call('ZREM', k.key, old)
      k.total = math.max(k.total + k.cost - w, 0)
      local write = {tonumber(s), k.member, k.total + k.stale, ''}
      if k.unit ~= 0 and k.unit ~= k.cost then write[5], write[6] = 0, '=' end
      redis.call('ZADD', k.key, unpack(write))
      k.dirty = false
      local slot = redis.call('ZSCORE', KEYS[n + i], old)
      if slot then
        redis.call('ZREM', KEYS[n + i], old)
        redis.call('ZADD', KEYS[n + i], slot, k.member)
      end
    end
  end
  flush()
  return summary(found > 0 and 7 or 0, now, 0, 0)
end

-- The common case first: an acquisition that fits every limit now.
if mode <= 1 and gate == now then
  local fits = true
  for i = 1, n do
    local k = ks[i]
    if k.total + k.cost > k.limit then fits = false end
  end
  if fits then
    for i = 1, n do add(ks[i], now) end
    return summary(1, now, 0, 0)
  end
end
if mode <= 2 and gate == now then
  -- The room of an abandoned slot (overdue by more than a quarter window and not
  -- started: a copy stuck behind a flood of messages, or lost) is not left unused: a
  -- call that does not fit counting every entry starts now if it fits counting what
  -- started, as a late task would (and a peek says so). (Measured, backlogs of 50-100x
  -- the limit, whose first copies come back seconds late: a drain 1.14-1.23 times the
  -- ideal, 1.05-1.11.)
  local fits = true
  for i = 1, n do
    local k = ks[i]
    if k.total + k.cost > k.limit then
      local gone = redis.call('ZCOUNT', KEYS[n + i], '(' .. string.format('%.0f', now - k.exact),
        math.floor(now - k.exact / 4))
      if gone == 0 or start_in(i, k, now) > now then
        fits = false
        break
      end
    end
  end
  if fits then
    if mode ~= 2 then
      for i = 1, n do add(ks[i], now) end
    end
    return summary(1, now, 0, 0)
  end
end


if mode == 4 then
  -- release: remove this call's entry, if it is still in the future
  for i = 1, n do
    local k = ks[i]
    redis.call('ZREM', KEYS[n + i], k.member)
    local s = redis.call('ZSCORE', k.key, k.member)
    if s and tonumber(s) > now then unlog(k, tonumber(s)) end
  end
  flush()
  return summary(4, now, 0, 0)
end

if mode == 3 or mode == 5 then
  local slot = nil
  if mode == 3 then
    slot = redis.call('ZSCORE', KEYS[n + 1], ks[1].member)
    slot = slot and tonumber(slot)
    if slot and slot - now > hold then
      flush()
      return summary(3, slot, slot - now, 0)
    end
    if not slot and redis.call('ZSCORE', ks[1].key, ks[1].member) then
      -- a task already started (or holds its start) on this reservation: this is a
      -- second execution (a message delivered again), which needs budget of its own
      flush()
      return summary(5, now, 0, 0)
    end
  end
  -- Due, late, lost or within `hold`: count what really started around t0.
  local t0 = math.max(slot or now, now)
  local start = t0
  for i = 1, n do
    local s = start_in(i, ks[i], t0)
    if s > start then start = s end
  end
  if gate > now or start - now > hold or start - t0 > hold / 4 then
    -- No room soon counting what started: taking the next room would push the task
    -- due there, and that one the next (a chain of deferrals through the whole
    -- backlog); waiting for it in-process, every task after a late one would wait
    -- as long (a prefork pool's processes all asleep). It is placed instead as a new
    -- reservation is, counting every entry, reservations included: deferred once, and
    -- no other task moves. (Up to a quarter of `hold` past its own slot is waited:
    -- the jitter of ordinary starts.) Not before the gate.
    start = gate
    for i = 1, n do
      local k = ks[i]
      local own = redis.call('ZSCORE', k.key, k.member)
      if own then unlog(k, tonumber(own)) end
      local excess = k.total + k.cost - k.limit
      if excess > 0 then
        local s = free_at(k, excess)
        if s > start then start = s end
      end
    end
  end
  if na > 0 then start = cal_at(start) end
  local wait = start - now
  for i = 1, n do
    local k = ks[i]
    if redis.call('ZSCORE', k.key, k.member) then
      local write = {start, k.member}
      if k.dirty then
        write[3], write[4] = k.total + k.stale, ''
        k.dirty = false
      end
      extend(k, start, write)
    else
      add(k, start)
    end
    if wait > hold or not gate_firm then pend(i, start) else pend(i, nil) end
  end
  if wait > hold or not gate_firm then
    return summary(3, start, wait, 0)
  elseif wait > 0 then
    return summary(6, start, wait, 0)
  end
  return summary(1, now, 0, 0)
end

local at, denied_by = now, 0
for i = 1, n do
  local k = ks[i]
  local excess = k.total + k.cost - k.limit
  if excess > 0 then
    local s = free_at(k, excess)
    if s > at then
      at, denied_by = s, i
    end
  end
end

if gate > at then at, denied_by = gate, gate_by end
if na > 0 then
  local s, by = cal_at(at)
  if s > at then at, denied_by = s, aidx + by end
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
  status = (at - now > hold or not gate_firm) and 2 or 6
end

for i = 1, n do
  add(ks[i], at)
  if status == 2 then pend(i, at) end
end
return summary(status, at, at - now, denied_by)
