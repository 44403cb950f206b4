-- lib/settle_body.lua — what settle.lua does (its header: KEYS, ARGV, flag and reply)
-- for the call `c` (lib/call.lua, read_call) whose ARGV is `argv` (the weights the call
-- was counted at follow its numbers). `cal`: the functions of lib/cal_edit.lua for a
-- call with aligned limits (nil: it has none).

local function settle(c, argv, cal)
  local log = c.flag == 'log'
  local now, token = c.now, c.token
  read_settings(c)
  local found = false
  local ks, cals, counted = {}, {}, nil

  for i, spec in ipairs(c.logs) do
    local was = tonumber(argv[c.rest + i - 1])
    if log then
      local k = log_open(spec, token, now, c.guard, true)
      local old = was == 1 and token or token .. '.' .. was
      local s = redis.call('ZSCORE', k.key, old)
      if s and tonumber(s) > now - k.window then
        found = true
        redis.call('ZREM', k.key, old)
        k.total = math.max(k.total + k.cost - was, 0)
        local write = {tonumber(s), k.member, k.total + k.stale, ''}
        if k.unit ~= 0 and k.unit ~= k.cost then write[5], write[6], k.unit = 0, '=', 0 end
        redis.call('ZADD', k.key, unpack(write))
        k.dirty = false
        local slot = redis.call('ZSCORE', k.pending, old)
        if slot then
          redis.call('ZREM', k.pending, old)
          redis.call('ZADD', k.pending, slot, k.member)
        end
      end
      log_flush(k)
      ks[i] = k
    else
      local h = redis.call('HMGET', spec.key, 'w', 'c')
      local used = 0
      if tonumber(h[1]) == math.floor(now / spec.window) then
        used = math.max(tonumber(h[2]) + spec.cost - was, 0)
        redis.call('HSET', spec.key, 'c', used)
        found = true
      end
      local free = spec.limit - used
      if counted == nil or free < counted[1] then counted = {free, 0} end
    end
  end
  for j, spec in ipairs(c.cals) do
    cals[j] = cal.open(spec, token, now, false, false)
    local was = tonumber(argv[c.rest + #c.logs + j - 1])
    if cal.settle(cals[j], was, token) then found = true end
  end
  return reply(found and 7 or 0, now, 0, 0, now, ks, cal, cals, {}, counted)
end
