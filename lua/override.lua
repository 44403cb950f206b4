-- override.lua — set or remove the rate override of a key: every decision on the key
-- uses it (lib/call.lua, read_settings) until it lapses or is removed.
--
-- KEYS: [1] the key's settings hash.
-- ARGV: [1] limit (0: remove the override), [2] window µs, [3] how long, µs (0: until
-- removed).
-- Reply: 1.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local key, limit, window, ttl = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local till = ttl > 0 and now + ttl or 0
if limit > 0 then
  redis.call('HSET', key, 'rate', string.format('%.0f %.0f %.0f', limit, window, till))
else
  redis.call('HDEL', key, 'rate')
end
-- the hash lasts as long as its override (for good: `till` 0) or its pause
local last = math.max(till, tonumber(redis.call('HGET', key, 'pause') or 0))
if limit > 0 and till == 0 then
  redis.call('PERSIST', key)
elseif last > now then
  redis.call('PEXPIRE', key, math.ceil((last - now) / 1000) + 1000)
else
  redis.call('DEL', key)
end
return 1
