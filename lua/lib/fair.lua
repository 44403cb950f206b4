-- lib/fair.lua — fair shares: which waiting call takes the next free slot of a limit key
-- when calls of several fair-key values (tenants) wait for it (Limit(fair_key=...)).
--
-- The slots themselves stay where the exact window puts them (lib/log.lua): fairness
-- only decides which waiting call holds which slot, so the window invariant and the
-- work conservation of the FIFO order are kept as they are. A start-time fair queue:
--   V        the virtual time: the tag of the call holding the earliest future slot
--            (never decreasing while anyone waits)
--   F[f]     the finish tag of value f's last reservation
--   a reservation of value f, cost c, weight w gets tag F[f] = max(V, F[f]) + c / w
-- Its place is after every waiting call whose tag is not above its own: its rank p in
-- slot order is the number of them. The slot at rank p (held by D, of the same cost)
-- becomes the new call's, and D takes the slot the new call was placed at, the last:
-- one call moves, not the whole backlog. D keeps its tag, so the calls placed after the
-- swap still count it ahead of them until V passes it. D's copy comes back at its old
-- slot, is told its slot moved (start.lua, status 3) and is published again for it: a
-- swap costs one limiter call and one message more, for D alone. A tenant starting to wait behind a
-- backlog of thousands so gets its k-th slot after about k * (sum of waiting weights) /
-- its weight slots. Nobody else waiting (no future slot pending): the queue is reset
-- and nothing moves. A call granted now never reaches this code.
-- Limits: one sliding log limit per call (a stacked limit would need the swap in every
-- log); D must have the same cost as the new call; a call of the key without a fair key
-- has no tag and is not counted ahead of anyone.
--
-- Data (the fair limit's log key + ":q" and + ":v"): a sorted set of the waiting calls'
-- tags (log member -> tag) and a hash: "" -> V, "f:" .. value -> F[value], "m:" ..
-- member -> its value. Only tags from V up count; a tag below V leaves with its "m:"
-- field once its call has no pending slot (it started, or was released).

-- How many tagged calls below a tag one placement reads at most (the tenants' shares
-- ahead of the call), and how many tags below V it looks at for calls that left:
-- bounds on the script's work, not on correctness.
local FAIR_SCAN = 1000
local FAIR_PRUNE = 200

-- The virtual time V of the queue `fair` ({tags, state, value, weight}) whose log's
-- pending set is `pending`: never below the stored one, raised to the tag of the call
-- holding the earliest slot still to come (`first`); the calls below it that left
-- the pending set are dropped.
local function fair_virtual(fair, pending, first, stored)
  local v = stored
  local head = redis.call('ZSCORE', fair.tags, first)
  if head and tonumber(head) > v then v = tonumber(head) end
  local low = redis.call('ZRANGEBYSCORE', fair.tags, '-inf', '(' .. v, 'LIMIT', 0, FAIR_PRUNE)
  if #low == 0 then return v end
  local slots = redis.call('ZMSCORE', pending, unpack(low))
  local gone, fields = {}, {}
  for j = 1, #low do
    if not slots[j] then
      gone[#gone + 1] = low[j]
      fields[#fields + 1] = 'm:' .. low[j]
    end
  end
  if #gone > 0 then
    redis.call('ZREM', fair.tags, unpack(gone))
    redis.call('HDEL', fair.state, unpack(fields))
  end
  return v
end

-- The slot the call `member` (cost `cost`, placed at `at` and written there in the log
-- `key` whose pending set is `pending`) takes under the fair queue `fair`, and the
-- queue's writes: its own tag, and the swap with the call D it goes ahead of (D's log
-- entry and pending slot moved to `at`). `ttl_ms`: how long the queue is kept (as the
-- pending set). A Concurrency's turns: `pending` is its waiters, `key` nil (no log).
local function fair_place(fair, key, pending, member, cost, at, now, ttl_ms)
  local first = redis.call('ZRANGEBYSCORE', pending, '(' .. us(now), '+inf', 'LIMIT', 0, 1)
  if #first == 0 then redis.call('DEL', fair.tags, fair.state) end
  local state = redis.call('HMGET', fair.state, '', 'f:' .. fair.value)
  local v, last = tonumber(state[1] or 0), tonumber(state[2] or 0)
  if first[1] then v = fair_virtual(fair, pending, first[1], v) end
  local tag = math.max(v, last) + cost / fair.weight
  redis.call('HSET', fair.state, '', v, 'f:' .. fair.value, tag, 'm:' .. member, fair.value)
  redis.call('ZADD', fair.tags, tag, member)
  redis.call('PEXPIRE', fair.state, ttl_ms)
  redis.call('PEXPIRE', fair.tags, ttl_ms)
  if #first == 0 then return at end

  -- p: the waiting calls ahead of this one (tag not above its own, slot still to come)
  local ahead = redis.call('ZRANGEBYSCORE', fair.tags, v, tag, 'LIMIT', 0, FAIR_SCAN)
  local p = 0
  local slots = redis.call('ZMSCORE', pending, unpack(ahead))
  for j = 1, #ahead do
    local s = slots[j] and tonumber(slots[j])
    if s and s > now then p = p + 1 end
  end
  local taken = redis.call('ZRANGEBYSCORE', pending, '(' .. us(now), '+inf', 'WITHSCORES',
    'LIMIT', p, 1)
  local d, slot = taken[1], taken[2] and tonumber(taken[2])
  if not d or slot >= at or string.sub(d, TOKEN_LEN + 1) ~= string.sub(member, TOKEN_LEN + 1)
    or redis.call('HGET', fair.state, 'm:' .. d) == fair.value then
    return at
  end
  if key then redis.call('ZADD', key, slot, member, at, d) end
  redis.call('ZADD', pending, at, d)
  return slot
end

-- The reservation of the call `c` (lib/call.lua) with a fair queue, placed at `at` and
-- written there in the logs `ks` (lib/log.lua): its status and slot. A call of one
-- sliding limit takes its place among the waiting calls of its key; a slot taken over
-- within `hold` is a start there (status 6), only if it fits counting what really
-- started, as its confirm would be (lib/start_body.lua): calls may have taken the room
-- of abandoned slots since it was placed; else it stays a reservation (status 2), and
-- its confirm places it. A call of one Concurrency and nothing else takes its turn
-- among the waiters' (the queue kept as its keys are). Any other call keeps its slot.
local function fair_reserve(c, ks, at, now)
  if #ks == 1 and #c.cals == 0 and #c.concs == 0 then
    local k = ks[1]
    local slot = fair_place(c.fair, k.key, k.pending, k.member, k.cost, at, now,
      log_keep_ms(k, at, now))
    if slot - now <= c.hold and log_start_in(k, slot, now, c.hold) <= slot
      and (not k.pace or log_start_in(pace_window(k), slot, now, c.hold) <= slot) then
      return 6, slot
    end
    return 2, slot
  elseif #ks == 0 and #c.cals == 0 and #c.concs == 1 then
    local cc = c.concs[1]
    local keep = math.max(redis.call('PTTL', cc.h), 60000)
    return 2, fair_place(c.fair, nil, cc.w, c.token, 1, at, now, keep)
  end
  return 2, at
end
