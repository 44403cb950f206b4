-- lib/settings.lua — writes to a key's settings hash besides an override: a pause, and
-- keeping the hash as long as what it holds.

-- Keep the settings hash `key` at least until `till` (µs; for good once persisted by a
-- lasting override).
local function settings_keep(key, now, till)
  local ttl = redis.call('PTTL', key)
  local need = math.ceil((till - now) / 1000) + 1000
  if ttl ~= -1 and ttl < need then redis.call('PEXPIRE', key, need) end
end

-- Pause `key` for `us` µs from now (a later end already there wins); returns its end.
local function settings_pause(key, now, us)
  local till = math.max(now + us, tonumber(redis.call('HGET', key, 'pause') or 0))
  redis.call('HSET', key, 'pause', till)
  settings_keep(key, now, till)
  return till
end
