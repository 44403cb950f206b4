-- The park: deferred copies of tasks that wait in Redis, not in a worker's memory, until
-- they are nearly due (see celery_ratelimit/_park.py). Every node's mover claims the
-- copies coming due, publishes them to the broker, then drops them; a claim lapses after
-- its lease, so a copy whose mover died before publishing it is claimed again: a copy
-- is published at least once, never lost.
--
-- KEYS[1]  sorted set: copy id -> when it is due (µs, Redis time); while a mover
--          publishes it: when that mover's claim lapses
-- KEYS[2]  hash: copy id -> "<due µs>|<payload>" (the payload is opaque here)
-- KEYS[3]  hash: calls of each operation ("park", "claim", "drop") and copies published
--          ("published"), for monitoring; "mover": when a mover last claimed (µs)
-- KEYS[4]  hash: copy id -> the id of the mover whose claim holds it
-- KEYS[5]  hash: the token of a call waiting for a concurrency slot -> its copy's id
-- KEYS[6]  list: wakes a mover blocked on it (a copy called in)
-- ARGV[1]  "park" | "claim" | "drop" | "call"
--
-- park   ARGV[2] copy id, ARGV[3] delay (µs from now), ARGV[4] payload, ARGV[5] how
--        recently (µs) some mover must have claimed: a park no mover serves takes no copy.
--        ARGV[6] (optional) the token of the call if it waits for a concurrency slot
--        that may be handed to it (its copy may be called in), ARGV[7] how long (µs)
--        after the usual lead ahead of its due time it is claimed (it comes nearer its
--        turn; called in when the turn is handed to it).
--        Reply: when the copy is due (µs, Redis time), or -1 if it was not parked.
-- call   ARGV[2] a waiting call's token: its turn was handed to it, so its copy is due
--        now; a mover is woken to publish it. Reply: 1, or 0 if no copy of that call is
--        parked unclaimed (it waits in a worker or the broker, or is being published).
-- claim  ARGV[2] lead (µs): claim copies due within this from now;
--        ARGV[3] lease (µs); ARGV[4] at most this many copies; ARGV[5] the mover's id;
--        ARGV[6] "1": first the copies this mover's earlier claims hold (a claim whose
--        reply it lost: a timeout while Redis was paused still ran the claim after).
--        Reply: {now µs, the earliest score left (µs) or -1, id, value, id, value, ...}
-- drop   ARGV[2..] copy ids that were published. Reply: how many were dropped.

local op = ARGV[1]
redis.call('HINCRBY', KEYS[3], op, 1)

if op == 'drop' then
  local ids = {}
  for i = 2, #ARGV do
    ids[#ids + 1] = ARGV[i]
  end
  if #ids == 0 then
    return 0
  end
  redis.call('HDEL', KEYS[2], unpack(ids))
  redis.call('HDEL', KEYS[4], unpack(ids))
  for _, id in ipairs(ids) do
    local token = id:match('^(.*)~')
    if token and redis.call('HGET', KEYS[5], token) == id then redis.call('HDEL', KEYS[5], token) end
  end
  redis.call('HINCRBY', KEYS[3], 'published', #ids)
  return redis.call('ZREM', KEYS[1], unpack(ids))
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])

if op == 'park' then
  local mover = tonumber(redis.call('HGET', KEYS[3], 'mover') or '0')
  if now - mover > tonumber(ARGV[5]) then
    return -1
  end
  local due = now + tonumber(ARGV[3])
  redis.call('HSET', KEYS[2], ARGV[2], string.format('%.0f', due) .. '|' .. ARGV[4])
  redis.call('ZADD', KEYS[1], due + tonumber(ARGV[7] or 0), ARGV[2])
  if ARGV[6] and ARGV[6] ~= '' then
    redis.call('HSET', KEYS[5], ARGV[6], ARGV[2])
    redis.call('PEXPIRE', KEYS[5], math.ceil(tonumber(ARGV[3]) / 1000) + 86400000)
  end
  return due
end

if op == 'call' then
  local id = redis.call('HGET', KEYS[5], ARGV[2])
  if not id or redis.call('HGET', KEYS[4], id) then return 0 end
  local value = redis.call('HGET', KEYS[2], id)
  if not value then
    redis.call('HDEL', KEYS[5], ARGV[2])
    return 0
  end
  local bar = value:find('|', 1, true)
  redis.call('HSET', KEYS[2], id, string.format('%.0f', now) .. value:sub(bar))
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('DEL', KEYS[6]) -- one wake-up is enough for any number of copies
  redis.call('RPUSH', KEYS[6], '1')
  redis.call('PEXPIRE', KEYS[6], 60000)
  return 1
end

if op == 'claim' then
  redis.call('HSET', KEYS[3], 'mover', string.format('%.0f', now))
  local lapse = now + tonumber(ARGV[3])
  local most = tonumber(ARGV[4])
  local mover = ARGV[5]
  local ids = {}
  if ARGV[6] == '1' then
    local holders = redis.call('HGETALL', KEYS[4])
    for i = 1, #holders, 2 do
      if holders[i + 1] == mover and #ids < most then
        ids[#ids + 1] = holders[i]
      end
    end
  end
  if #ids < most then
    local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + tonumber(ARGV[2]),
      'LIMIT', 0, most - #ids)
    for _, id in ipairs(due) do
      ids[#ids + 1] = id
    end
  end
  local reply = {now, -1}
  local seen = {}
  for _, id in ipairs(ids) do
    local value = redis.call('HGET', KEYS[2], id)
    if value and not seen[id] then
      seen[id] = true -- a copy both held and due: once
      redis.call('ZADD', KEYS[1], lapse, id)
      redis.call('HSET', KEYS[4], id, mover)
      reply[#reply + 1] = id
      reply[#reply + 1] = value
    elseif not value then
      redis.call('ZREM', KEYS[1], id) -- dropped meanwhile: nothing to publish
      redis.call('HDEL', KEYS[4], id)
    end
  end
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if first[2] then
    reply[2] = tonumber(first[2])
  end
  return reply
end

return redis.error_reply('unknown park operation ' .. tostring(op))
