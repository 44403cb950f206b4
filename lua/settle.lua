-- settle.lua — the call ARGV[1], counted at the weights its token carries, now weighs its
-- real cost (0 or more, and it may exceed the limit). A refund frees budget at once; a
-- surcharge may put a window over its limit, which the next calls wait out. Entries
-- keep their instants; one that has left its window, or was never written, is left
-- alone. The counter keeps no entries: the difference is counted in its current window,
-- if the call was counted in it.
--
-- KEYS and ARGV: a decision's (lib/call.lua), its costs the real ones, then the weight
-- each rate limit (sliding, then aligned) counted the call at. ARGV[2], the flag: the
-- algorithm of the sliding limits, "log" or "counter".
-- Reply: a decision's, status 7 (0: no entry of the call was found).

--- @include "lib/call.lua"
--- @include "lib/log.lua"
--- @include "lib/gate.lua"
--- @include "lib/reply.lua"

local log = ARGV[2] == 'log'
local c = read_call(KEYS, ARGV, log)
local now, token = c.now, c.token
read_settings(c)
local found = false
local ks, cals, counted = {}, {}, nil

for i, spec in ipairs(c.logs) do
  local was = tonumber(ARGV[c.rest + i - 1])
  if log then
    local k = log_open(spec, token, now, c.guard, true)
    local old = was == 1 and token or token .. '.' .. was
    local s = redis.call('ZSCORE', k.key, old)
    if s and tonumber(s) > now - k.window then
      found = true
      redis.call('ZREM', k.key, old)
      k.total = math.max(k.total + k.cost - was, 0)
      local write = {tonumber(s), k.member, k.total + k.stale, ''}
      if k.unit ~= 0 and k.unit ~= k.cost then write[5], write[6], k.unit = 0, '=', 0 end
      redis.call('ZADD', k.key, unpack(write))
      k.dirty = false
      local slot = redis.call('ZSCORE', k.pending, old)
      if slot then
        redis.call('ZREM', k.pending, old)
        redis.call('ZADD', k.pending, slot, k.member)
      end
    end
    log_flush(k)
    ks[i] = k
  else
    local h = redis.call('HMGET', spec.key, 'w', 'c')
    local used = 0
    if tonumber(h[1]) == math.floor(now / spec.window) then
      used = math.max(tonumber(h[2]) + spec.cost - was, 0)
      redis.call('HSET', spec.key, 'c', used)
      found = true
    end
    local free = spec.limit - used
    if counted == nil or free < counted[1] then counted = {free, 0} end
  end
end
local lib = #c.cals > 0 and gate_lib() or nil
for j, spec in ipairs(c.cals) do
  cals[j] = lib.cal_open(spec, token, now, false, false)
  if lib.cal_settle(cals[j], tonumber(ARGV[c.rest + #c.logs + j - 1]), token) then found = true end
end
return reply(found and 7 or 0, now, 0, 0, now, ks, lib, cals, {}, counted)
