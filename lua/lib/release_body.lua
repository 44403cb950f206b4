-- lib/release_body.lua — what release.lua does (its header: KEYS, ARGV, flag and reply)
-- for the call `c` (lib/call.lua, read_call). `cal`, `conc`: the functions of
-- lib/cal_edit.lua and lib/conc_release.lua for a call with aligned or concurrency
-- limits (nil: it has none).

local function release(c, cal, conc)
  local log = c.flag == 'log'
  local now = c.now
  -- a body that ends hands its slot to the first waiter (lib/conc_release.lua), not while
  -- its key is paused
  local hand = read_settings(c) <= now
  local ks, cals, handed = {}, {}, {}
  if log then
    for i, spec in ipairs(c.logs) do
      local k = log_open(spec, c.token, now, c.guard, true)
      redis.call('ZREM', k.pending, k.member)
      local s = redis.call('ZSCORE', k.key, k.member)
      if s and tonumber(s) > now then log_remove(k, tonumber(s), now) end
      log_flush(k)
      ks[i] = k
    end
  end
  if cal then
    for j, spec in ipairs(c.cals) do
      cals[j] = cal.open(spec, c.token, now, true, true)
      cal.release(cals[j], now)
    end
  end
  if conc then
    for _, cc in ipairs(c.concs) do
      handed[#handed + 1] = conc.release(cc, c.token, now, hand)
    end
  end
  local r = reply(4, now, 0, 0, now, ks, cal, cals, c.concs)
  -- after the reply's six: the tokens of the waiters handed a slot (their copies are
  -- called in by the caller: the park is another key's)
  for _, token in ipairs(handed) do r[#r + 1] = token end
  return r
end
