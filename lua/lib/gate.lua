-- lib/gate.lua — what holds a call back besides its sliding rate limits: a pause of its
-- keys, its concurrency limits' turns and its aligned limits' windows; and what its
-- answer writes to them. Included after lib/concurrency.lua and lib/calendar.lua.

-- The aligned limits' states of the call `c` (lib/call.lua).
local function open_cals(c, write, own)
  local cals = {}
  for j, spec in ipairs(c.cals) do cals[j] = cal_open(spec, c.token, c.now, write, own) end
  return cals
end

-- The earliest instant the call may start at as far as a pause (until `pause`, 0: none),
-- the concurrency limits `concs` and the aligned limits `cals` say; the index of the limit that
-- set it (lib/call.lua's denied_by, 0: none); and whether that instant is firm (a
-- concurrency turn is only expected: it is confirmed again when it comes). `waiter`: the
-- call holds a turn in line.
local function gate_at(c, concs, cals, pause, waiter, write)
  local gate, by, firm = c.now, 0, true
  if pause > gate then gate, by = pause, c.paused_by end
  for j, cc in ipairs(concs) do
    local at = conc_gate(cc, c.token, c.now, waiter, write)
    if at > gate then gate, by, firm = at, #c.logs + #c.cals + j, false end
  end
  if #cals > 0 then
    local s, a = cal_at(cals, gate, c.now, c.horizon)
    if s > gate then gate, by = s, #c.logs + a end
  end
  return gate, by, firm
end

-- Write what the answer `status` (lib/call.lua) means for the concurrency and aligned
-- limits: a start at `at` takes a slot, a reservation keeps a place in line, and
-- either counts the call in the window holding `at`.
local function gate_commit(c, cals, status, at)
  for _, cc in ipairs(c.concs) do
    if status == 1 or status == 6 then
      conc_take(cc, c.token, at)
    elseif status == 2 or status == 3 then
      conc_wait(cc, c.token, at)
    end
  end
  if status == 1 or status == 2 or status == 3 or status == 6 then
    for _, cal in ipairs(cals) do cal_count(cal, at, c.now) end
  end
end
