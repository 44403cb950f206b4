-- observe.lua — what an upstream's response headers said (celery_ratelimit._headers),
-- written where every decision on the keys reads it (lib/call.lua, read_settings).
--
-- KEYS: for each of m limits, its settings hash; then each of those limits' own key (a
-- log, an aligned limit's sorted set or a counter's hash), in the same order; the same
-- for each of q limits whose effective rate to cut (Limit(adapt=True)); then the
-- settings hash of every key to pause.
-- ARGV: [1] m; [2] q; [3] the pause, µs (0: none); [4] since, µs of Redis time: the
-- grant of the call whose response this was (0: now); then, for each of the m limits,
-- r (units the upstream has left), reset (µs from now until it is back to full) and l
-- (its quota, 0: not said, or not of this limit's window); then, for each of the q, its
-- declared limit, window (µs), the units it gives back a window and the share of the
-- effective rate a cut keeps (per mille).
-- Reply: 1.
--
-- A limit's field "seen:<algorithm>:<window>" becomes "r t l lu" (and the hash's "up"
-- field 1: decisions read the limits' fields only where it is): r units are left
-- until the instant t, l the upstream's quota in force until lu. r counts, besides what
-- the upstream said, every unit granted on the limit after `since` and before t (those
-- calls had not reached the upstream when it answered; a counter keeps no instants, so
-- only what is granted from now on counts). An l not said keeps the one in force.

--- @include "lib/entry.lua"
--- @include "lib/settings.lua"

-- An observed quota holds this long past its reset when no answer says it again.
local QUOTA_LIFE = 3600 * 1000000

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local m, q = tonumber(ARGV[1]), tonumber(ARGV[2])
local pause, since = tonumber(ARGV[3]), tonumber(ARGV[4])
if since == 0 or since > now then since = now end

-- Units granted on the limit `key` in (since, till): its entries' weights.
local function unseen(key, till)
  if till <= since or not string.match(key, ':log:%d+$') and not string.match(key, ':cal:%d+$') then
    return 0
  end
  local low = string.format('(%.0f', math.max(since, ENTRY_FLOOR))
  local high = string.format('(%.0f', till)
  local unit = tonumber(redis.call('ZSCORE', key, '=') or 0)
  if unit > 0 and string.match(key, ':log:%d+$') then
    return redis.call('ZCOUNT', key, low, high) * unit
  end
  local total = 0
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', key, low, high)) do
    total = total + weight_of(member)
  end
  return total
end

for i = 1, m do
  local settings, key = KEYS[i], KEYS[m + i]
  local a = 5 + 3 * (i - 1)
  local r, t, l = tonumber(ARGV[a]), now + tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local field = 'seen:' .. string.match(key, '([^:]+:%d+)$')
  local lu = 0
  if l > 0 then
    lu = t + QUOTA_LIFE
  else
    local old = redis.call('HGET', settings, field)
    if old then
      local ol, olu = string.match(old, '^%d+ %d+ (%d+) (%d+)$')
      if ol and tonumber(olu) > now then l, lu = tonumber(ol), tonumber(olu) end
    end
  end
  r = math.max(r - unseen(key, t), 0)
  redis.call('HSET', settings, field, string.format('%.0f %.0f %.0f %.0f', r, t, l, lu), 'up', 1)
  settings_keep(settings, now, math.max(t, lu))
end
for j = 1, q do
  local key, a = KEYS[2 * m + q + j], 5 + 3 * m + 4 * (j - 1)
  settings_cut(KEYS[2 * m + j], 'eff:' .. string.match(key, '([^:]+:%d+)$'), now, since,
    tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
end
if pause > 0 then
  for k = 2 * (m + q) + 1, #KEYS do settings_pause(KEYS[k], now, pause) end
end
return 1
