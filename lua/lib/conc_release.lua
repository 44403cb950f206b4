-- lib/conc_release.lua — a release's concurrency limits (Concurrency(n)): a body that
-- ends frees its slot and hands it to the first waiter in line (the keys and the
-- rules: lib/conc_keys.lua). Included only in release.lua's script of a call that
-- declares concurrency limits: the file defines one local, `concurrency`, the table of
-- the functions release_body.lua uses (the rest are local to its block).

local concurrency
do
--- @include "lib/conc_keys.lua"

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
    -- one body held far longer (its release delayed by an outage of Redis, a stalled
    -- worker) teaches at most twice the average: the turns of a line are placed by it
    if avg > 0 then took = math.min(took, 2 * avg) end
    avg = avg > 0 and avg + (took - avg) / 4 or took
    redis.call('ZADD', cc.h, math.max(math.floor(avg), 1), '')
    redis.call('ZREM', cc.h, token)
    redis.call('ZREM', cc.s, token)
    if hand then handed = conc_hand(cc, now) end
  end
  conc_keep(cc)
  return handed
end

concurrency = {release = conc_release}
end
