-- concurrency.lua — a call with no sliding rate limit: concurrency limits (gate.lua)
-- and calendar-aligned limits (calendar.lua).
--
-- KEYS      the aligned limits' keys, the concurrency limits' keys (three each), then
--           the settings hashes
-- ARGV[1]   token: 8 bytes; the member this call holds a slot (or its turn) by
-- ARGV[2]   packed doubles: mode, horizon, guard, hold, nc, ns, na (as in
--           sliding_log.lua), (limit, window µs, cost) of every aligned limit, (most,
--           lease µs) of every concurrency limit, then calendar.lua's boundaries
-- Modes as sliding_log.lua's: 0 start now or deny, 1 start now or take a turn in line,
-- 2 peek, 3 start the waiter ARGV[1], 4 release, 5 keep (a late start holds its slot),
-- 6 renew, 7 pause, 9 settle (aligned limits). Reply: {status, remaining, retry_after, reset_after, denied_by, at} with
-- sliding_log.lua's statuses (2 and 3: a turn in line at `at`; confirm then).

local ENTRY_FLOOR = 1e13
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token = ARGV[1]
local mode, horizon, guard, hold, nc, ns, na = struct.unpack('<ddddddd', ARGV[2])
local nlimits, cbase, sbase, coff = na, na, na + 3 * nc, 57 + 24 * na
local abase, aidx, aoff, boff = 0, 0, 57, coff + 16 * nc

--- @include "gate.lua"
--- @include "calendar.lua"

local function reply(status, at, denied_by)
  commit(status, at)
  cal_commit(status, at)
  local wait = status == 0 and gate - now or at - now
  local remaining, reset = cal_reply(conc_free(), 0)
  return {status, math.max(remaining or 0, 0), math.max(wait, 0), reset, denied_by,
    status == 0 and now or at}
end

if mode == 4 then return reply(4, now, 0) end
if mode == 9 then
  local was = {struct.unpack('<' .. string.rep('d', na), ARGV[2], boff + 48 * na)}
  return reply(cal_settle(was) > 0 and 7 or 0, now, 0)
end
if mode == 5 and gate <= now then return reply(1, now, 0) end
if mode == 3 and nc > 0 and redis.call('ZSCORE', cs[1].s, token) then
  -- already started on (a message delivered twice): compete afresh
  return {5, 0, 0, 0, 0, now}
end
if gate <= now then return reply(1, now, 0) end
if mode == 0 or mode == 2 or (mode == 1 and gate - now > horizon) then
  return reply(0, now, gate_by)
end
return reply((mode == 3 or mode == 5) and 3 or 2, gate, gate_by)
