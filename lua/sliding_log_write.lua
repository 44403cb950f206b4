-- sliding_log_write.lua — sliding_log.lua's writers and its reply, included by it
-- (they use its locals: now, n, ks and what gate.lua defines).

local function summary(status, at, retry_after, denied_by)
  commit(status, at)
  cal_commit(status, at)
  local remaining, reset = cal_reply(conc_free(), 0)
  for i = 1, n do
    local k = ks[i]
    local free = k.limit - k.total
    if remaining == nil or free < remaining then remaining = free end
    if k.total > 0 then
      local r = k.newest + k.window - now
      if r > reset then reset = r end
    end
  end
  if remaining < 0 then remaining = 0 end
  return {status, remaining, retry_after, reset, denied_by, at}
end

-- Keep k's expiry and newest-entry meta in step with an entry placed at t, in the
-- entry's own ZADD (`write`: score, member pairs).
local function extend(k, t, write)
  if t > k.newest then
    k.newest = t
    write[#write + 1] = -t
    write[#write + 1] = '+'
  end
  if t + k.window > k.expiry then
    local ttl = math.ceil((t + k.window - now) / 1000) + TTL_MARGIN_MS
    write[#write + 1] = -(now + ttl * 1000)
    write[#write + 1] = '~'
    redis.call('ZADD', k.key, unpack(write))
    redis.call('PEXPIRE', k.key, ttl)
  else
    redis.call('ZADD', k.key, unpack(write))
  end
end

-- Add this call's entry at t to k: its weight joins the running total (and the
-- uniform-weight meta), in the entry's own ZADD.
local function add(k, t)
  local cost = k.cost
  local write = {t, k.member, k.total + k.stale + cost, ''}
  if k.total + k.stale == 0 then
    write[5], write[6] = cost, '='
  elseif k.unit ~= 0 and k.unit ~= cost then
    write[5], write[6] = 0, '='
  end
  k.total = k.total + cost
  k.dirty = false
  extend(k, t, write)
end

-- Write back the totals that pruning changed (a denial writes no entry).
local function flush()
  for i = 1, n do
    local k = ks[i]
    if k.dirty then redis.call('ZADD', k.key, k.total + k.stale, '') end
  end
end

-- Keep the pending entry of key i at t (or drop it: t == nil), pruning slots whose
-- window has passed.
local function pend(i, t)
  local key, k = KEYS[n + i], ks[i]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - k.window)
  if t == nil then
    redis.call('ZREM', key, k.member)
  else
    redis.call('ZADD', key, t, k.member)
    -- only ever extend: the set also holds slots further ahead than this one
    local ttl = math.ceil((t + k.window - now) / 1000) + TTL_MARGIN_MS
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
end

-- Remove this call's own entry from k, stored at instant s, keeping the running
-- total and the newest-entry meta in step (a release, or a start placed anew).
local function unlog(k, s)
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
