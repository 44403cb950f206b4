-- lib/release_body.lua — what release.lua and release_gated.lua do (their header: KEYS, ARGV,
-- flag and reply) for the call `c` (lib/call.lua, read_call). `gates`: the functions of
-- lib/gate.lua (gate_lib) for a call with aligned or concurrency limits, nil for a call
-- with sliding limits only.

local function release(c, gates)
  local log = c.flag == 'log'
  local now = c.now
  -- a body that ends hands its slot to the first waiter (lib/concurrency.lua), not while
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
  if gates then
    for j, spec in ipairs(c.cals) do
      cals[j] = gates.cal_open(spec, c.token, now, true, true)
      gates.cal_release(cals[j], now)
    end
    for _, cc in ipairs(c.concs) do
      handed[#handed + 1] = gates.conc_release(cc, c.token, now, hand)
    end
  end
  local r = reply(4, now, 0, 0, now, ks, gates, cals, c.concs)
  -- after the reply's six: the tokens of the waiters handed a slot (their copies are
  -- called in by the caller: the park is another key's)
  for _, token in ipairs(handed) do r[#r + 1] = token end
  return r
end
