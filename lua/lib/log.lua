-- lib/log.lua — the exact sliding-window log of one limit: opening it (expired entries
-- pruned), the two searches for an instant, and its writes. Functions of a limit's
-- state table `k`, which log_open returns:
--   key, pending  the log and its pending set (reservations whose task has not started)
--   limit, cost   weight units; member = token, then "." .. cost when cost is not 1
--   window        where calls are placed: W + g (g: lib/call.lua's guard)
--   exact         where starts are checked: W + g / 2
--   total         weight in the window; stale: weight of expired entries still stored
--   newest, unit, expiry  the meta members: the newest entry's instant, the weight
--                 every entry has (0 once mixed), when the key's PEXPIRE runs out
--   pace          a paced limit's pace (lib/pace.lua; its meta member PACE_MEMBER),
--                 taken by every entry log_add writes; nil when not paced
--
-- The log, a sorted set: one entry per granted or reserved call, score = its instant
-- (µs, later than now for a reservation). Meta members score below ENTRY_FLOOR, so
-- range scans over entries never see them; one ZMSCORE reads them all and the entry's
-- own ZADD writes them: "" the running total weight (expired entries not yet removed
-- included), "+" minus the newest instant, "=" the uniform weight, "~" minus expiry.
--
-- Invariant: in every window (t - W, t] the weight of the entries that count is at most
-- the limit. A call is placed at the earliest s at which its cost fits every window
-- holding s, counting every entry (lib/log_search.lua, log_fit_at): retry_after is exact.

--- @include "lib/pace.lua" if pace else "lib/no_pace.lua"

local TTL_MARGIN_MS = 1000
-- At most this many expired entries are removed per call once a log holds more (the
-- rest on later calls): a burst of 100,000 entries leaving at once would hold Redis
-- for tens of milliseconds in one call.
local PRUNE_BATCH = 500

-- Prune k's expired entries (count them only, when not `write`): a batch at a time
-- once the log is long.
local function log_prune(k, now, write)
  local key, cutoff = k.key, now - k.window
  if k.newest <= cutoff and (k.unit == 0 or k.total <= PRUNE_BATCH * k.unit) then
    -- the whole log has left the window
    if write then redis.call('DEL', key) end
    k.total, k.newest, k.expiry, k.unit = 0, 0, 0, 0
    return
  end
  if k.unit > 0 then
    local gone
    if write and k.total <= PRUNE_BATCH * k.unit then
      gone = redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
      k.dirty = gone > 0
    else
      gone = redis.call('ZCOUNT', key, ENTRY_FLOOR, cutoff)
      if write and gone > 0 then
        -- a long log: its oldest PRUNE_BATCH expired entries go (up to the score of
        -- the last of them, by rank), the rest stay stored as `stale` weight
        local upto = cutoff
        if gone > PRUNE_BATCH then
          local edge = redis.call('ZCOUNT', key, '-inf', '(' .. ENTRY_FLOOR) + PRUNE_BATCH - 1
          upto = redis.call('ZRANGE', key, edge, edge, 'WITHSCORES')[2]
        end
        k.stale = (gone - redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, upto)) * k.unit
        k.dirty = true
      end
    end
    k.total = k.total - gone * k.unit
  else
    local old = redis.call('ZRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
    for j = 1, #old do k.total = k.total - weight_of(old[j]) end
    if write and #old > 0 then
      redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
      k.dirty = true
    end
  end
  if k.total < 0 then k.total = 0 end
end

-- The state of the log of `spec` ({key, pending, limit, window, cost}, lib/call.lua)
-- for the call `token`, pruned when `write`.
local function log_open(spec, token, now, guard, write)
  local slack = math.min(guard, math.floor(spec.window / 25))
  local meta
  if spec.burst then
    meta = redis.call('ZMSCORE', spec.key, '', '+', '=', '~', PACE_MEMBER)
  else
    meta = redis.call('ZMSCORE', spec.key, '', '+', '=', '~')
  end
  local k = {key = spec.key, pending = spec.pending, limit = spec.limit,
    window = spec.window + slack, exact = spec.window + math.floor(slack / 2),
    cost = spec.cost, member = spec.cost == 1 and token or token .. '.' .. spec.cost,
    total = meta[1] and tonumber(meta[1]) or 0, stale = 0, dirty = false,
    newest = meta[2] and -tonumber(meta[2]) or 0, unit = meta[3] and tonumber(meta[3]) or 0,
    expiry = meta[4] and -tonumber(meta[4]) or 0,
    pace = pace_open(spec, meta[5] and -tonumber(meta[5]))}
  if k.total > 0 then log_prune(k, now, write) end
  return k
end

-- How long (ms) k's keys are kept for an entry or a slot at t: its window, and a margin.
local function log_keep_ms(k, t, now)
  return math.ceil((t + k.window - now) / 1000) + TTL_MARGIN_MS
end

-- Write the call's entry at t with `write` ({score, member, ...} of one ZADD), keeping
-- the newest-entry and expiry meta members in step in the same ZADD.
local function log_write(k, t, now, write)
  if t > k.newest then
    k.newest = t
    write[#write + 1] = -t
    write[#write + 1] = '+'
  end
  if t + k.window > k.expiry then
    local ttl = log_keep_ms(k, t, now)
    k.expiry = now + ttl * 1000
    write[#write + 1] = -k.expiry
    write[#write + 1] = '~'
    redis.call('ZADD', k.key, unpack(write))
    redis.call('PEXPIRE', k.key, ttl)
  else
    redis.call('ZADD', k.key, unpack(write))
  end
end

-- Add the call's entry at t: its weight joins the running total (and the uniform
-- weight), and its cost the pace, in the entry's own ZADD.
local function log_add(k, t, now)
  local write = {t, k.member, k.total + k.stale + k.cost, ''}
  if k.total + k.stale == 0 then
    write[5], write[6], k.unit = k.cost, '=', k.cost
  elseif k.unit ~= 0 and k.unit ~= k.cost then
    write[5], write[6], k.unit = 0, '=', 0
  end
  if k.pace then
    write[#write + 1] = pace_take(k.pace, k.cost, t, '-')
    write[#write + 1] = PACE_MEMBER
  end
  k.total = k.total + k.cost
  k.dirty = false
  log_write(k, t, now, write)
end

-- Write back the running total that pruning changed (when no entry was written).
local function log_flush(k)
  if k.dirty then
    redis.call('ZADD', k.key, k.total + k.stale, '')
    k.dirty = false
  end
end

-- Keep the call's pending slot at t (nil: drop it), pruning slots whose window passed.
local function log_pend(k, t, now)
  redis.call('ZREMRANGEBYSCORE', k.pending, '-inf', now - k.window)
  if t == nil then
    redis.call('ZREM', k.pending, k.member)
    return
  end
  redis.call('ZADD', k.pending, t, k.member)
  -- only ever extended: the set holds slots further ahead than this one too
  local ttl = log_keep_ms(k, t, now)
  if redis.call('PTTL', k.pending) < ttl then redis.call('PEXPIRE', k.pending, ttl) end
end
