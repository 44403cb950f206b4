-- lib/concurrency.lua — a decision's concurrency limits (Concurrency(n)): when a call may
-- start, its slot taken or its place in line kept (the keys and the rules:
-- lib/conc_keys.lua). Included only in the script of a call that declares concurrency
-- limits (a release includes lib/conc_release.lua, renew.lua renews a lease by itself):
-- the file defines one local, `concurrency`, the table of the functions its callers use
-- (the rest are local to its block).

local concurrency
do
--- @include "lib/conc_keys.lua"

-- A guess of a body's time before any body has ended: what the longest-running one has
-- taken so far, at least this (µs). Too short costs a waiter one more check; too long
-- would leave slots idle.
local FIRST_GUESS = 100000

-- The expected turn of the waiter `rank` places back in line under cc.
local function conc_turn(cc, starts, rank, now)
  local avg = tonumber(redis.call('ZSCORE', cc.h, '') or 0)
  if avg <= 0 then
    avg = FIRST_GUESS
    if #starts > 0 and now - tonumber(starts[2]) > avg then avg = now - tonumber(starts[2]) end
  end
  local lanes = {}
  for i = 2, #starts, 2 do
    -- a body past its expected end is expected within an eighth of the average
    lanes[#lanes + 1] = math.max(tonumber(starts[i]) + avg, now + math.floor(avg / 8))
  end
  table.sort(lanes)
  while #lanes > cc.most do table.remove(lanes, 1) end
  for _ = #lanes + 1, cc.most do table.insert(lanes, 1, now) end
  return lanes[rank % cc.most + 1] + math.floor(rank / cc.most) * avg
end

-- When the call `token` may start under cc: now, or its expected turn. A lost worker's
-- lapsed slots come back and stale waiters leave the line (when `write`). `waiter`: the
-- call holds a turn in line (a confirmation), kept in its place.
local function conc_gate(cc, token, now, waiter, write)
  local lapsed = redis.call('ZRANGEBYSCORE', cc.h, ENTRY_FLOOR, now)
  if #lapsed > 0 and write then
    redis.call('ZREM', cc.s, unpack(lapsed))
    redis.call('ZREMRANGEBYSCORE', cc.h, ENTRY_FLOOR, now)
    for _, gone in ipairs(lapsed) do redis.call('DEL', conc_go(cc, gone)) end
  end
  if write then
    redis.call('ZREMRANGEBYSCORE', cc.w, '-inf', '(' .. string.format('%.0f', now - GRACE))
    redis.call('ZREMRANGEBYSCORE', cc.h .. HANDOFF, '-inf', now)
  end
  local starts = redis.call('ZRANGE', cc.s, 0, -1, 'WITHSCORES')
  local held = #starts / 2 - (write and 0 or #lapsed)
  local mine = waiter and redis.call('ZSCORE', cc.w, token)
  -- ahead: the waiters whose turn has come before this call's; rank: its place in line
  -- (a new call's is at the back)
  local ahead, rank
  if mine then
    rank = redis.call('ZCOUNT', cc.w, now - GRACE, '(' .. mine)
    ahead = tonumber(mine) <= now and rank or redis.call('ZCOUNT', cc.w, now - GRACE, now)
  else
    ahead = redis.call('ZCOUNT', cc.w, now - GRACE, now)
    rank = redis.call('ZCOUNT', cc.w, now - GRACE, '+inf')
  end
  cc.free = cc.most - held - ahead
  if cc.free > 0 then return now end
  return conc_turn(cc, starts, rank, now)
end

-- The call's body starts at `at`: it takes a slot.
local function conc_take(cc, token, at)
  redis.call('ZADD', cc.h, at + cc.lease, token)
  redis.call('ZADD', cc.s, at, token)
  redis.call('ZREM', cc.w, token)
  redis.call('ZREM', cc.h .. HANDOFF, token)
  cc.free = cc.free - 1
  conc_keep(cc)
end

-- The call keeps a place in line for its turn at `at`; `handy`: it may be handed a turn
-- (it has no other limit).
local function conc_wait(cc, token, at, handy)
  redis.call('ZREM', cc.h, token)
  redis.call('ZREM', cc.s, token)
  redis.call('ZADD', cc.w, at, token)
  if handy then redis.call('ZADD', cc.h .. HANDOFF, at + GRACE, token) end
  conc_keep(cc)
end

-- The call `token` was handed a turn it has not taken yet, still held: it takes it (true).
local function conc_handed(cc, token)
  return redis.call('LPOP', conc_go(cc, token)) ~= false
    and redis.call('ZSCORE', cc.h, token) ~= false
end

-- The earliest instant from `gate` (set by limit `by`, lib/call.lua's denied_by) the call
-- `c` may start at as far as its concurrency limits say; the index of the limit that set
-- it; and whether that instant is firm (a turn is only expected: it is confirmed again
-- when it comes). `waiter`: the call holds a turn in line.
local function conc_gates(c, gate, by, waiter, write)
  local firm = true
  for j, cc in ipairs(c.concs) do
    local at = conc_gate(cc, c.token, c.now, waiter, write)
    if at > gate then gate, by, firm = at, #c.logs + #c.cals + j, false end
  end
  return gate, by, firm
end

-- Write what the answer `status` (lib/call.lua) means: a start at `at` takes a slot, a
-- reservation keeps a place in line.
local function conc_commit(c, status, at)
  -- a call with one concurrency limit and no other may be handed a turn (conc_hand)
  local handy = #c.concs == 1 and #c.logs == 0 and #c.cals == 0
  for _, cc in ipairs(c.concs) do
    if status == 1 or status == 6 then
      conc_take(cc, c.token, at)
    elseif status == 2 or status == 3 then
      conc_wait(cc, c.token, at, handy)
    end
  end
end

-- The call `c`, on time but held back by its turn at `at`, keeps its place in line (no
-- later than `at`, and not so early that it would be given up before it comes back).
local function conc_stay(c, at)
  for _, cc in ipairs(c.concs) do
    local mine = redis.call('ZSCORE', cc.w, c.token)
    local place = mine and math.max(math.min(tonumber(mine), at), at - GRACE / 2) or at
    conc_wait(cc, c.token, place, false)
  end
end

-- The call `c` gives up its places in line: it will compete again as a new call.
local function conc_leave(c)
  for _, cc in ipairs(c.concs) do
    redis.call('ZREM', cc.w, c.token)
    redis.call('ZREM', cc.h .. HANDOFF, c.token)
  end
end

concurrency = {gate = conc_gates, commit = conc_commit, handed = conc_handed, stay = conc_stay,
  leave = conc_leave}
end
