-- lib/acquire_body.lua — the decision of acquire_full.lua (its header: KEYS, ARGV, flags
-- and reply): count the call `c` (lib/call.lua, read_call) now against every limit of
-- its key, all or nothing, or reserve it. `cal`, `conc`: the functions of
-- lib/calendar.lua and lib/concurrency.lua for a call with aligned or concurrency
-- limits (nil: it has none). `place`: lib/fair.lua's fair_reserve, for a call that
-- takes its place in a fair queue (nil: it does not).
--
-- A call that does not fit counting every entry still starts now when it fits counting
-- what started and a slot of the window was abandoned (lib/log.lua, log_abandoned): a
-- start confirmed late would take that room too.
--
-- A grant is counted c.lead after now (lib/call.lua's ARGV[9]): where its body's first
-- request is expected to reach its server (celery_ratelimit/_green.py, lead).
--
-- A call that does not fit now is placed at the earliest instant it fits every limit,
-- counting every entry (lib/log_search.lua, logs_place): a hole in a line of
-- reservations is taken before the end of the line.
--
-- A paced limit (lib/pace.lua) holds the call back until it conforms to its pace too; a
-- reservation takes its pace at its slot, so a backlog's slots come one interval apart.

local function acquire(c, cal, conc, place)
  local now, write = c.now, c.flag ~= 'peek'
  local gate, gate_by = read_settings(c, true)
  local ks, cals, firm = {}, {}, true
  for i, spec in ipairs(c.logs) do ks[i] = log_open(spec, c.token, now, c.guard, write) end
  if cal then cals = cal.open_all(c, write, false) end
  if conc then gate, gate_by, firm = conc.gate(c, gate, gate_by, false, write) end
  if cal then gate, gate_by = cal.gate(c, cals, gate, gate_by) end

  local function answer(status, at, retry_after, denied_by)
    if write then
      for _, k in ipairs(ks) do log_flush(k) end
      if conc then conc.commit(c, status, at) end
      if cal then cal.commit(cals, status, at, now) end
      if status == 1 or status == 2 or status == 6 then seen_take(c, at) end
    end
    return reply(status, at, retry_after, denied_by, now, ks, cal, cals, c.concs)
  end

  if gate == now then
    local fits = true
    for _, k in ipairs(ks) do
      if pace_at(k.pace, k.cost, now) > now or k.total + k.cost > k.limit
        and (log_abandoned(k, now) == 0 or log_start_in(k, now, now, c.hold) > now) then
        fits = false
        break
      end
    end
    if fits then
      if write then
        for _, k in ipairs(ks) do log_add(k, now + c.lead, now) end
      end
      return answer(1, now, 0, 0)
    end
  end

  local at, denied_by = now, 0
  if gate > at then at, denied_by = gate, gate_by end
  local push = nil
  if cal then push = function(s, by) return cal.gate(c, cals, s, by) end end
  at, denied_by = logs_place(ks, at, denied_by, now, push)

  if c.flag == 'peek' then
    if denied_by == 0 then return answer(1, now, 0, 0) end
    return answer(0, now, at - now, denied_by)
  end
  if denied_by ~= 0 and (c.flag ~= 'reserve' or at - now > c.horizon) then
    return answer(0, now, at - now, denied_by)
  end
  local status, slot = 1, at
  if denied_by ~= 0 then status = (at - now > c.hold or not firm) and 2 or 6 end
  for _, k in ipairs(ks) do log_add(k, at, now) end
  if status == 2 and place then status, slot = place(c, ks, at, now) end
  if status == 2 then
    for _, k in ipairs(ks) do log_pend(k, slot, now) end
  end
  return answer(status, slot, slot - now, denied_by)
end
