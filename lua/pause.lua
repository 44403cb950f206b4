-- pause.lua — grant nothing on some keys for a while (an upstream answered 429): every
-- decision on them reads the pause (lib/call.lua, read_settings). A later end wins.
--
-- KEYS: the settings hash of each key.
-- ARGV: [1] how long, µs.
-- Reply: µs until the pause ends (the longest of the keys').

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local longest = now
for _, key in ipairs(KEYS) do
  local till = math.max(now + tonumber(ARGV[1]), tonumber(redis.call('HGET', key, 'pause') or 0))
  if till > longest then longest = till end
  redis.call('HSET', key, 'pause', till)
  -- the hash lasts at least as long as the pause (for good with a lasting override)
  local ttl = redis.call('PTTL', key)
  local need = math.ceil((till - now) / 1000) + 1000
  if ttl ~= -1 and ttl < need then redis.call('PEXPIRE', key, need) end
end
return longest - now
