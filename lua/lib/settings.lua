-- lib/settings.lua — writes to a key's settings hash besides an override: a pause, a
-- cut of an effective rate, and keeping the hash as long as what it holds.

-- Keep the settings hash `key` at least until `till` (µs; for good once persisted by a
-- lasting override). A hash this call has just created has no expiry yet either: only
-- a lasting override (`rate` ending in a `till` of 0) keeps one for good.
local function settings_keep(key, now, till)
  local ttl = redis.call('PTTL', key)
  local need = math.ceil((till - now) / 1000) + 1000
  if ttl == -1 then
    local rate = redis.call('HGET', key, 'rate')
    if rate and string.match(rate, ' 0$') then return end
  end
  if ttl < need then redis.call('PEXPIRE', key, need) end
end

-- Pause `key` for `us` µs from now (a later end already there wins); returns its end.
local function settings_pause(key, now, us)
  local till = math.max(now + us, tonumber(redis.call('HGET', key, 'pause') or 0))
  redis.call('HSET', key, 'pause', till)
  settings_keep(key, now, till)
  return till
end

-- Halve the effective rate of a limit of `limit` units per `window` µs (Limit(adapt=True))
-- kept in the field `field` of `settings`: "e cut step", e units at the instant cut,
-- `step` more for each whole window since, up to `limit` (lib/call.lua reads it); never
-- below 1. The 429 of a call granted at `since` cuts only when that is a whole window
-- after the last cut: until then the upstream's window still holds calls sent at the
-- rate before it, and their 429s say nothing of the rate now (one burst, one signal).
-- Returns the effective limit.
local function settings_cut(settings, field, now, since, limit, window, step, keep)
  local eff, cut = limit, 0
  local old = redis.call('HGET', settings, field)
  if old then
    local e, at = string.match(old, '^(%d+) (%d+)')
    if e then
      cut = tonumber(at)
      eff = math.min(limit, tonumber(e) + math.floor((now - cut) / window) * step)
    end
  end
  if since - cut < window then return eff end
  eff = math.max(math.floor(eff * keep / 1000), 1)
  redis.call('HSET', settings, field, string.format('%.0f %.0f %.0f', eff, now, step), 'up', 1)
  settings_keep(settings, now, now + math.ceil((limit - eff) / step) * window)
  return eff
end
