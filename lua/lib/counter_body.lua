-- lib/counter_body.lua — the decision of counter.lua (its header: KEYS, ARGV, flag and
-- reply): count the call `c` (lib/call.lua, read_call) now by the approximate sliding
-- window, or deny it. `cal`, `conc`: the functions of lib/calendar.lua and
-- lib/concurrency.lua for a call with aligned or concurrency limits (nil: it has none).
--
-- Estimate at time now, e µs into the current window of length W:
--     estimate(now) = p * (W - e) / W + c
-- A call fits when estimate + cost <= limit. retry_after solves that for the earliest
-- instant, assuming no other traffic meanwhile: later in this window if c + cost fits
-- (the p term shrinks linearly), else in the next window, where c becomes p.
-- A paced limit (lib/pace.lua) keeps its pace in the same hash (field t): a call
-- waits for it too.

local TTL_MARGIN_MS = 1000

local function counter(c, cal, conc)
  local now, write = c.now, c.flag ~= 'peek'
  local gate, gate_by = read_settings(c, true)
  local cals = {}
  if cal then cals = cal.open_all(c, write, false) end
  if conc then gate, gate_by = conc.gate(c, gate, gate_by, false, write) end
  if cal then gate, gate_by = cal.gate(c, cals, gate, gate_by) end

  -- Each limit's windows now, and the instant its cost fits.
  local at, denied_by, remaining, reset = now, 0, nil, 0
  local counters = {}
  for i, spec in ipairs(c.logs) do
    local limit, window, cost = spec.limit, spec.window, spec.cost
    local wid = math.floor(now / window)
    local h
    if spec.burst then
      h = redis.call('HMGET', spec.key, 'w', 'c', 'p', PACE_FIELD)
    else
      h = redis.call('HMGET', spec.key, 'w', 'c', 'p')
    end
    local pace = pace_open(spec, h[4])
    local w0 = tonumber(h[1])
    local cur, prev = tonumber(h[2]) or 0, tonumber(h[3]) or 0
    if w0 == nil or w0 < wid - 1 then
      cur, prev = 0, 0
    elseif w0 == wid - 1 then
      cur, prev = 0, cur
    end
    local start = wid * window
    local estimate = prev * (window - (now - start)) / window + cur
    if estimate + cost > limit then
      local fits
      if cur + cost <= limit then
        -- prev * (W - e) / W <= limit - cur - cost  =>  e >= W * (1 - (limit - cur - cost) / prev)
        fits = start + math.ceil(window * (1 - (limit - cur - cost) / prev)) + 1
      else
        -- next window: cur * (W - e) / W + cost <= limit
        local e = 0
        if cur > limit - cost then e = math.ceil(window * (1 - (limit - cost) / cur)) + 1 end
        fits = start + window + e
      end
      if fits > at then at, denied_by = fits, i end
    end
    local paced = pace_at(pace, cost, now)
    if paced > at then at, denied_by = paced, i end
    local free = math.floor(limit - estimate)
    if remaining == nil or free < remaining then remaining = free end
    local r = 0
    if cur > 0 then r = (wid + 2) * window - now elseif prev > 0 then r = (wid + 1) * window - now end
    if r > reset then reset = r end
    counters[i] = {wid = wid, cur = cur, prev = prev, pace = pace}
  end
  if gate > at then at, denied_by = gate, gate_by end
  if cal then at, denied_by = cal.gate(c, cals, at, denied_by) end

  if denied_by ~= 0 or not write then
    local status = denied_by == 0 and 1 or 0
    return reply(status, now, at - now, denied_by, now, {}, cal, cals, c.concs,
      {remaining, reset})
  end

  remaining = nil
  for i, spec in ipairs(c.logs) do
    local n, window = counters[i], spec.window
    local cur = n.cur + spec.cost
    if n.pace then
      redis.call('HSET', spec.key, 'w', n.wid, 'c', cur, 'p', n.prev,
        PACE_FIELD, pace_take(n.pace, spec.cost, now, ''))
    else
      redis.call('HSET', spec.key, 'w', n.wid, 'c', cur, 'p', n.prev)
    end
    redis.call('PEXPIRE', spec.key, math.ceil(2 * window / 1000) + TTL_MARGIN_MS)
    local r = (n.wid + 2) * window - now
    if r > reset then reset = r end
    local estimate = n.prev * (window - (now - n.wid * window)) / window + cur
    local free = math.floor(spec.limit - estimate)
    if remaining == nil or free < remaining then remaining = free end
  end
  if conc then conc.commit(c, 1, now) end
  if cal then cal.commit(cals, 1, now, now) end
  seen_take(c, now)
  return reply(1, now, 0, 0, now, {}, cal, cals, c.concs, {remaining, reset})
end
