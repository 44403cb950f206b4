-- index.lua — note in an index of the metrics (layout.index_key) that some keys are
-- paused or overridden until some instant, or no more. The index is a sorted set of
-- settings hashes scored by when their pause or override ends (µs; "+inf": no end), kept
-- as long as its last entry (for good once one has no end). Read by the gauges, which
-- drop lapsed entries.
--
-- KEYS[1]  the index
-- ARGV[1]  for how long (µs from now; "+inf": no end), or "" to remove
-- ARGV[2..] the settings hashes
-- Reply: how many entries the index holds.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local index, ends = KEYS[1], ARGV[1]
if ends ~= '' and ends ~= '+inf' then ends = string.format('%.0f', now + tonumber(ends)) end
local names = {}
for i = 2, #ARGV do names[#names + 1] = ARGV[i] end
if ends == '' then
  redis.call('ZREM', index, unpack(names))
  return redis.call('ZCARD', index)
end
local ttl = redis.call('PTTL', index)
for _, name in ipairs(names) do redis.call('ZADD', index, ends, name) end
if ends == '+inf' then
  redis.call('PERSIST', index)
elseif ttl ~= -1 then
  local need = math.ceil((tonumber(ends) - now) / 1000) + 1000
  if ttl < need then redis.call('PEXPIRE', index, need) end
end
return redis.call('ZCARD', index)
