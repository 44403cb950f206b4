-- lib/concurrency.lua — at most `most` bodies at once per key (Concurrency(n)). Functions
-- of a concurrency limit's state table `cc` ({h, s, w, most, lease, free}, lib/call.lua).
--
-- Three sorted sets per limit:
--   holders  token -> the instant its lease runs out (µs); meta member "" (scored below
--            ENTRY_FLOOR) = the average time a body held a slot (µs)
--   starts   token -> the instant its body started (µs)
--   waiters  token -> the instant its turn is expected (µs): denied calls that reserved
--            a turn, in order; one later than its turn by more than GRACE gives its turn
--            up (its task competes afresh if it ever comes)
--   holders .. ":go"  token -> until when (µs) a waiter may be handed a turn: the
--            waiters whose call has no other limit (see conc_hand)
--   holders .. ":go:" .. the token in hex  a list: the end of the lease of the turn
--            handed to that waiter (µs)
--
-- A turn handed over: a body that ends gives its slot, in the same script call, to the
-- first waiter in line (in fair order for a fair limit: lib/fair.lua ordered the line)
-- if that waiter may take one. The waiter holds the slot at once, on a short lease (its
-- expected turn + GRACE), and its handoff list says so: its worker, blocked on that list
-- (BLPOP) or confirming, starts the body without a second decision. A worker that died
-- meanwhile loses the turn when that lease runs out, as a lost holder's slot comes back.
--
-- A call may start when fewer than `most` bodies hold a slot besides the waiters whose
-- turn has come before it. Otherwise its turn: the n-th waiter in line (from 0) gets
-- lane n % most, after n // most bodies of the average time ahead of it there; a lane
-- is free when its holder's body is expected to end. Turns keep their order, so a queue
-- of waiters comes back one by one, not all at once.
--
-- Included only in the script of a call that declares concurrency limits (renew.lua
-- renews a lease by itself): the file defines one local, `concurrency`, the table of the
-- functions its callers use (the rest are local to its block).

local concurrency
do

local GRACE = 2000000
-- A guess of a body's time before any body has ended: what the longest-running one has
-- taken so far, at least this (µs). Too short costs a waiter one more check; too long
-- would leave slots idle.
local FIRST_GUESS = 100000
-- Keys are kept this long (ms) after a write, with the average time they have learnt.
local KEEP_MS = 86400000
local HANDOFF = ':go'

-- A call's token in hex, as its Decision gives it.
local function conc_hex(token)
  return (token:gsub('.', function(ch) return string.format('%02x', string.byte(ch)) end))
end

-- The handoff list of the call `token` under cc.
local function conc_go(cc, token)
  return cc.h .. HANDOFF .. ':' .. conc_hex(token)
end

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

local function conc_keep(cc)
  for _, key in ipairs({cc.h, cc.s, cc.w, cc.h .. HANDOFF}) do
    redis.call('PEXPIRE', key, KEEP_MS + math.ceil(cc.lease / 1000))
  end
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

-- A slot was freed: the first waiter in line takes it now if it may be handed a turn and
-- a slot is free, on a lease until its expected turn + GRACE; its handoff list says so.
-- Returns its token in hex (its copy, wherever it waits, is called in: release_body.lua).
local function conc_hand(cc, now)
  local first = redis.call('ZRANGEBYSCORE', cc.w, now - GRACE, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #first == 0 or not redis.call('ZSCORE', cc.h .. HANDOFF, first[1])
    or redis.call('ZCARD', cc.s) >= cc.most then
    return nil
  end
  local token, ends = first[1], math.max(now, tonumber(first[2])) + GRACE
  redis.call('ZADD', cc.h, ends, token)
  redis.call('ZADD', cc.s, now, token)
  redis.call('ZREM', cc.w, token)
  redis.call('ZREM', cc.h .. HANDOFF, token)
  local go = conc_go(cc, token)
  redis.call('DEL', go)
  redis.call('RPUSH', go, string.format('%.0f', ends))
  redis.call('PEXPIRE', go, math.ceil((ends - now) / 1000) + 1000)
  return conc_hex(token)
end

-- The call `token` was handed a turn it has not taken yet, still held: it takes it (true).
local function conc_handed(cc, token)
  return redis.call('LPOP', conc_go(cc, token)) ~= false
    and redis.call('ZSCORE', cc.h, token) ~= false
end

-- The call's body has ended (or will not run): its slot or turn is free again, handed
-- over (when `hand`) to the first waiter, and the time it held the slot teaches the
-- average. Returns the token of the waiter handed the slot, if any.
local function conc_release(cc, token, now, hand)
  local handed = nil
  redis.call('ZREM', cc.w, token)
  redis.call('ZREM', cc.h .. HANDOFF, token)
  redis.call('DEL', conc_go(cc, token))
  local start = redis.call('ZSCORE', cc.s, token)
  if start then
    local took = now - tonumber(start)
    local avg = tonumber(redis.call('ZSCORE', cc.h, '') or 0)
    avg = avg > 0 and avg + (took - avg) / 4 or took
    redis.call('ZADD', cc.h, math.max(math.floor(avg), 1), '')
    redis.call('ZREM', cc.h, token)
    redis.call('ZREM', cc.s, token)
    if hand then handed = conc_hand(cc, now) end
  end
  conc_keep(cc)
  return handed
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

concurrency = {gate = conc_gates, commit = conc_commit, release = conc_release,
  handed = conc_handed}
end
