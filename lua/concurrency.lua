-- concurrency.lua — a call with concurrency limits and no rate limit (see gate.lua).
--
-- KEYS      the concurrency limits' keys (three each), then the settings hashes
-- ARGV[1]   token: 8 bytes; the member this call holds a slot (or its turn) by
-- ARGV[2]   packed doubles: mode, horizon, guard, hold, nc, ns (as in sliding_log.lua),
--           then (most, lease µs) of every concurrency limit
-- Modes as sliding_log.lua's: 0 start now or deny, 1 start now or take a turn in line,
-- 2 peek, 3 start the waiter ARGV[1], 4 release, 5 keep (a late start holds its slot),
-- 6 renew, 7 pause. Reply: {status, remaining, retry_after, 0, denied_by, at} with
-- sliding_log.lua's statuses (2 and 3: a turn in line at `at`; confirm then).

local ENTRY_FLOOR = 1e13
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token = ARGV[1]
local mode, horizon, _, _, nc, ns = struct.unpack('<dddddd', ARGV[2])
local nlimits, cbase, sbase, coff = 0, 0, 3 * nc, 49

--- @include "gate.lua"

local function reply(status, at, denied_by)
  commit(status, at)
  local wait = status == 0 and gate - now or at - now
  return {status, conc_free() or 0, math.max(wait, 0), 0, denied_by, status == 0 and now or at}
end

if mode == 4 then return reply(4, now, 0) end
if mode == 5 then return reply(1, now, 0) end
if mode == 3 and redis.call('ZSCORE', cs[1].s, token) then
  -- already started on (a message delivered twice): compete afresh
  return {5, 0, 0, 0, 0, now}
end
if gate <= now then return reply(1, now, 0) end
if mode == 0 or mode == 2 or (mode == 1 and gate - now > horizon) then
  return reply(0, now, gate_by)
end
return reply(mode == 3 and 3 or 2, gate, gate_by)
