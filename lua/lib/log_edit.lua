-- lib/log_edit.lua — a call's entry of the log (lib/log.lua) moved or removed: a start
-- placed at another instant, a released reservation. Functions of a limit's state table
-- `k`.

-- Move the call's entry (stored) to t.
local function log_move(k, t, now)
  local write = {t, k.member}
  if k.dirty then
    write[3], write[4] = k.total + k.stale, ''
    k.dirty = false
  end
  log_write(k, t, now, write)
end

-- Remove the call's entry, stored at instant s (a release, or a start placed anew),
-- keeping the running total and the newest-entry meta in step.
local function log_remove(k, s, now)
  redis.call('ZREM', k.key, k.member)
  if s > now - k.window then k.total = math.max(k.total - k.cost, 0) end
  if s >= k.newest then
    local top = redis.call('ZREVRANGEBYSCORE', k.key, '+inf', ENTRY_FLOOR, 'WITHSCORES', 'LIMIT', 0, 1)
    k.newest = top[2] and tonumber(top[2]) or 0
    redis.call('ZADD', k.key, k.total + k.stale, '', -k.newest, '+')
  else
    redis.call('ZADD', k.key, k.total + k.stale, '')
  end
  k.dirty = false
end
