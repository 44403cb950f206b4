-- lib/plain.lua — a sliding log of one weight as the plain scripts read and write it:
-- meta members ("" total, "+" newest, "=" unit, "~" expiry: lib/log.lua), prune, entry.
--- @include "lib/fit.lua"

local ENTRY_FLOOR = 1e13
local PRUNE_BATCH = 500
-- as lib/entry.lua and lib/log.lua (tests/test_layout.py)
local TTL_MARGIN_MS = 1000

-- The log `key` of a call of weight `cost`, pruned (counted only, if not `write`): total,
-- newest, expiry, whether the total changed; nil: acquire_full.lua's (other weights, more
-- than PRUNE_BATCH expired).
local function plain_open(key, cost, now, window, write)
  local m = redis.call('ZMSCORE', key, '', '+', '=', '~')
  local total, newest, expiry = tonumber(m[1] or 0), -tonumber(m[2] or 0), -tonumber(m[4] or 0)
  if total == 0 then return 0, newest, expiry, false end
  if tonumber(m[3]) ~= cost then return nil end
  local cutoff, gone = now - window, 0
  if newest <= cutoff and total <= PRUNE_BATCH * cost then
    if write then redis.call('DEL', key) end
    return 0, 0, 0, false
  elseif write and total <= PRUNE_BATCH * cost then
    gone = redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff)
  else
    gone = redis.call('ZCOUNT', key, ENTRY_FLOOR, cutoff)
    if write and gone > PRUNE_BATCH then return nil end  -- pruned a batch a call
    if write and gone > 0 then redis.call('ZREMRANGEBYSCORE', key, ENTRY_FLOOR, cutoff) end
  end
  total = total - gone * cost
  if total < 0 then total = 0 end
  return total, newest, expiry, write and gone > 0
end

-- A full window's first room: the ceil((total + cost - limit) / cost)-th entry by rank,
-- or a hole in reservations ahead (lib/fit.lua); nil: acquire_full.lua's (an abandoned
-- slot; reservations ahead with `others`, several limits or a pause: logs_place).
local function plain_free(key, pending, now, window, exact, limit, cost, total, newest, others)
  if newest > now and others then return nil end
  local abandoned = string.format('(%.0f', now - exact)
  if redis.call('ZCOUNT', pending, abandoned, math.floor(now - exact / 4)) > 0 then
    return nil
  end
  local nth = redis.call('ZCOUNT', key, '-inf', string.format('%.0f', now - window))
    + math.ceil((total + cost - limit) / cost) - 1
  local row = redis.call('ZRANGE', key, nth, nth, 'WITHSCORES')
  local free = row[2] and tonumber(row[2]) + window or now + window
  if newest > now then free = fit_at(key, now, window, limit - cost, cost, counted_room, free) end
  return free
end

-- Denied until `at`: reserved there (2; 6 within `hold`) if asked and within the horizon.
local function plain_denied(flag, at, now, horizon, hold)
  local retry_after = at - now
  if flag ~= 'reserve' or retry_after > horizon then return 0, now, retry_after end
  if retry_after > hold then return 2, at, retry_after end
  return 6, at, retry_after
end

-- The entry `member` at `at` and the meta members in one ZADD (the expiry extended if
-- it outlives it), a reservation's slot (status 2) in `pending`: total and newest after.
local function plain_write(key, pending, status, at, member, cost, total, newest, expiry, window, now)
  if total > 0 and at > newest and at + window <= expiry then
    -- the usual entry: one more of the one weight, the newest
    redis.call('ZADD', key, at, member, total + cost, '', -at, '+')
  else
    local z = {at, member, total + cost, ''}
    if total == 0 then z[5], z[6] = cost, '=' end
    if at > newest then z[#z + 1], z[#z + 2] = -at, '+' end
    if at + window > expiry then
      local ttl = math.ceil((at + window - now) / 1000) + TTL_MARGIN_MS
      z[#z + 1], z[#z + 2] = -(now + ttl * 1000), '~'
      redis.call('ZADD', key, unpack(z))
      redis.call('PEXPIRE', key, ttl)
    else
      redis.call('ZADD', key, unpack(z))
    end
  end
  if status == 2 then
    redis.call('ZREMRANGEBYSCORE', pending, '-inf', now - window)
    redis.call('ZADD', pending, at, member)
    local ttl = math.ceil((at + window - now) / 1000) + TTL_MARGIN_MS
    if redis.call('PTTL', pending) < ttl then redis.call('PEXPIRE', pending, ttl) end
  end
  return total + cost, math.max(newest, at)
end
