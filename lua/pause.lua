-- pause.lua — grant nothing on some keys for a while (an upstream answered 429): every
-- decision on them reads the pause (lib/call.lua, read_settings). A later end wins.
--
-- KEYS: the settings hash of each key.
-- ARGV: [1] how long, µs.
-- Reply: µs until the pause ends (the longest of the keys').

--- @include "lib/settings.lua"

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local longest = now
for _, key in ipairs(KEYS) do
  local till = settings_pause(key, now, tonumber(ARGV[1]))
  if till > longest then longest = till end
end
return longest - now
