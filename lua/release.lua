-- release.lua — give back what the call ARGV[1] holds: its reservation (log entries and
-- aligned-window entries still in the future, its pending slots), and its concurrency
-- slots or turns in line (its body has ended, or will not run). A slot a body gives back
-- goes to the first waiter in line, in this call (lib/concurrency.lua, conc_hand).
--
-- KEYS and ARGV: a decision's (lib/call.lua). ARGV[2], the flag: the algorithm of the
-- sliding limits, "log" or "counter" (whose windows hold no entry to give back).
-- Reply: a decision's, status 4.

--- @include "lib/call.lua"
--- @include "lib/log.lua"
--- @include "lib/gate.lua"
--- @include "lib/reply.lua"

local log = ARGV[2] == 'log'
local c = read_call(KEYS, ARGV, log)
local now = c.now
-- a body that ends hands its slot to the first waiter (lib/concurrency.lua), not while
-- its key is paused
local hand = read_settings(c) <= now
local ks, cals = {}, {}
if log then
  for i, spec in ipairs(c.logs) do
    local k = log_open(spec, c.token, now, c.guard, true)
    redis.call('ZREM', k.pending, k.member)
    local s = redis.call('ZSCORE', k.key, k.member)
    if s and tonumber(s) > now then log_remove(k, tonumber(s), now) end
    log_flush(k)
    ks[i] = k
  end
end
local lib = (#c.cals > 0 or #c.concs > 0) and gate_lib() or nil
if lib then
  for j, spec in ipairs(c.cals) do
    cals[j] = lib.cal_open(spec, c.token, now, true, true)
    lib.cal_release(cals[j], now)
  end
  for _, cc in ipairs(c.concs) do lib.conc_release(cc, c.token, now, hand) end
end
return reply(4, now, 0, 0, now, ks, lib, cals, c.concs)
