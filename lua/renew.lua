-- renew.lua — extend the leases of the concurrency slots the call ARGV[1] holds while its
-- body runs.
--
-- KEYS: holders, starts and waiters of each concurrency limit (lib/concurrency.lua).
-- ARGV: [1] token, [2] .. the lease (µs) of each limit.
-- Reply: 1 if every slot was still held, 0 if a lease had run out (another call may have
-- taken the slot).

--- @include "lib/entry.lua"
--- @include "lib/concurrency.lua"

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local kept = 1
for j = 1, #KEYS / 3 do
  local cc = {h = KEYS[3 * j - 2], s = KEYS[3 * j - 1], w = KEYS[3 * j], lease = tonumber(ARGV[j + 1])}
  if not concurrency.renew(cc, ARGV[1], now) then kept = 0 end
end
return kept
