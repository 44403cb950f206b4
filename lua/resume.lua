-- resume.lua — end the pause of some keys now (an operator's resume): decisions on them
-- grant again from the next one. Calls already placed past the pause keep their slots.
--
-- KEYS: the settings hash of each key.
-- ARGV: none.
-- Reply: µs the longest of the pauses had left (0: none was in force).

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local left = 0
for _, key in ipairs(KEYS) do
  local till = tonumber(redis.call('HGET', key, 'pause') or 0)
  if till - now > left then left = till - now end
  -- an emptied hash goes with its last field; its expiry stays the pause's, which only
  -- keeps an override that lasts longer for that much longer
  redis.call('HDEL', key, 'pause')
end
return left
