-- renew.lua — extend the leases of the concurrency slots the call ARGV[1] holds while its
-- body runs.
--
-- KEYS: holders, starts and waiters of each concurrency limit (lib/conc_keys.lua).
-- ARGV: [1] token, [2] .. the lease (µs) of each limit.
-- Reply: 1 if every slot was still held, 0 if a lease had run out (another call may have
-- taken the slot).

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local kept = 1
for j = 1, #KEYS / 3 do
  -- the holders' set: token -> the instant its lease runs out (lib/conc_keys.lua)
  local holders, token = KEYS[3 * j - 2], ARGV[1]
  if redis.call('ZSCORE', holders, token) then
    redis.call('ZADD', holders, now + tonumber(ARGV[j + 1]), token)
  else
    kept = 0
  end
end
return kept
