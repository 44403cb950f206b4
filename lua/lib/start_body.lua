-- lib/start_body.lua — the start of start.lua (its header: KEYS, ARGV, flags and reply):
-- start the call `c` (lib/call.lua, read_call). `cal`, `conc`: the functions of
-- lib/calendar.lua and lib/concurrency.lua for a call with aligned or concurrency
-- limits (nil: it has none). The one place the timing rules of a start live.
--
-- From t0 = max(now, slot), the task starts at the earliest instant its cost fits
-- every window counting what really started (lib/log.lua, log_start_in); its entry
-- moves there: now (status 1) or within `hold` (status 6), when that is at most `hold`
-- / 4 past t0. A late task thus never bunches with the next ones, and an overdue one
-- starts ahead of the slots still to come when their room is free. Otherwise (status 3)
-- it is placed as a new reservation would be, at the earliest instant it fits counting
-- every entry (a hole in the line first), and within the horizon (else denied, status
-- 0: it competes again): taking the next room that started tasks leave would push the
-- task due there, and that one the next, a chain of deferrals through the whole
-- backlog; waiting longer in-process would make every task after a late one wait as
-- long. A task on time but held back only by its turn in a concurrency line keeps its
-- slot and comes back at that turn.
-- A paced limit (lib/pace.lua): a slot was paced when it was reserved; its start is
-- checked, by the same rule, in a window of one interval holding at most the burst
-- (pace_window): a task whose copy came late never bunches with the starts before it.
-- A task placed anew takes a paced slot as a reservation does, and not one in an
-- interval that late starts have filled.

local function start(c, cal, conc)
  local now, hold, reserved = c.now, c.hold, c.flag == 'reserved'
  local gate, gate_by = read_settings(c)
  local paused = gate > now
  if not reserved then gate, gate_by = now, 0 end  -- a grant's key was not paused then
  local ks, cals, firm = {}, {}, true
  for i, spec in ipairs(c.logs) do ks[i] = log_open(spec, c.token, now, c.guard, true) end
  if cal then cals = cal.open_all(c, true, true) end
  -- a grant already holds its concurrency slots
  if conc and reserved then gate, gate_by, firm = conc.gate(c, gate, gate_by, true, true) end
  if cal then gate, gate_by = cal.gate(c, cals, gate, gate_by) end

  local function answer(status, at, retry_after, denied_by)
    for _, k in ipairs(ks) do log_flush(k) end
    if conc then conc.commit(c, status, at) end
    if cal then cal.commit(cals, status, at, now) end
    return reply(status, at, retry_after, denied_by, now, ks, cal, cals, c.concs)
  end

  if #ks == 0 then
    -- only aligned and concurrency limits: their gate decides. A turn handed over to this
    -- call (lib/conc_release.lua, conc_hand) is its own: it starts now, on its full lease.
    if reserved and not paused and #c.concs == 1 and #c.cals == 0
      and conc.handed(c.concs[1], c.token) then
      return answer(1, now, 0, 0)
    end
    if reserved and #c.concs > 0 and redis.call('ZSCORE', c.concs[1].s, c.token) then
      return {5, 0, 0, 0, 0, now}
    end
    if gate <= now then return answer(1, now, 0, 0) end
    return answer(3, gate, gate - now, gate_by)
  end

  local slot = nil
  if reserved then
    -- every log is asked: a shorter window's log and pending set forget a token first,
    -- and a start's entry kept by a longer one must not be taken for a lost reservation
    local entry = false
    for _, k in ipairs(ks) do
      slot = slot or redis.call('ZSCORE', k.pending, k.member)
      entry = entry or redis.call('ZSCORE', k.key, k.member) ~= false
    end
    slot = slot and tonumber(slot)
    if slot and slot - now > hold then return answer(3, slot, slot - now, 0) end
    if not slot and entry then
      for _, one in ipairs(ks) do log_flush(one) end
      return reply(5, now, 0, 0, now, ks, cal, cals, c.concs)
    end
  end

  local t0 = math.max(slot or now, now)
  local start = t0
  for _, k in ipairs(ks) do
    local s = log_start_in(k, t0, now, hold)
    if s > start then start = s end
    if k.pace then
      s = log_start_in(pace_window(k), t0, now, hold)
      if s > start then start = s end
    end
  end
  if reserved and not paused and gate > now and gate_by > #c.logs + #c.cals
    and start - now <= hold and start - t0 <= hold / 4 then
    -- on time for its rate slot, held back only by its turn in a concurrency line: it
    -- keeps its slot and its place in line and comes back at its turn. Placed anew, it
    -- would go behind every reservation, and no later call could use the room it leaves.
    -- (not before its own slot either, when it came early)
    local at, by = math.max(gate, start), start > gate and 0 or gate_by
    if cal and at > gate then at = cal.gate(c, cals, at, 0) end
    for _, k in ipairs(ks) do log_flush(k) end
    conc.stay(c, at)
    if cal then cal.commit(cals, 3, at, now) end
    return reply(3, at, at - now, by, now, ks, cal, cals, c.concs)
  end
  if gate > now or start - now > hold or start - t0 > hold / 4 then
    -- no room soon counting what started: placed as a new reservation is, at the
    -- earliest instant it fits counting every entry, not before the gate
    local paced = false
    for _, k in ipairs(ks) do
      local own = redis.call('ZSCORE', k.key, k.member)
      if own then log_remove(k, tonumber(own), now) end
      paced = paced or k.pace ~= nil
    end
    local push = nil
    if paced or cal then
      push = function(s, by)
        for _, k in ipairs(ks) do
          if k.pace then s = math.max(s, log_start_in(pace_window(k), s, now, hold)) end
        end
        if cal then s = cal.gate(c, cals, s, 0) end
        return s, by
      end
    end
    local by
    start, by = logs_place(ks, gate, gate > now and gate_by or 0, now, push)
    if start - now > c.horizon then
      -- not within the horizon: no slot so far ahead (as for a new call); the task
      -- competes again, its place in any line given up
      for _, k in ipairs(ks) do log_pend(k, nil, now) end
      if conc then conc.leave(c) end
      return answer(0, now, start - now, by)
    end
  elseif cal then
    start = cal.gate(c, cals, start, 0)
  end

  local wait = start - now
  local later = wait > hold or not firm
  for _, k in ipairs(ks) do
    if redis.call('ZSCORE', k.key, k.member) then
      log_move(k, start, now)
    else
      log_add(k, start, now)
    end
    log_pend(k, later and start or nil, now)
  end
  if later then return answer(3, start, wait, 0) end
  if wait > 0 then return answer(6, start, wait, 0) end
  return answer(1, now, 0, 0)
end
