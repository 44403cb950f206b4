-- lib/gate.lua — what holds a call back besides its sliding rate limits and a pause: its
-- concurrency limits' turns and its aligned limits' windows, and what the answer writes
-- to them. gate_lib() builds these functions (with lib/calendar.lua's and
-- lib/concurrency.lua's) and returns them. Only the _gated entry scripts include this
-- file, for a call that declares such limits: a plain rate limit's script holds none of
-- it.

local function gate_lib()
--- @include "lib/calendar.lua"
--- @include "lib/concurrency.lua"

-- The aligned limits' states of the call `c` (lib/call.lua).
local function open_cals(c, write, own)
  local cals = {}
  for j, spec in ipairs(c.cals) do cals[j] = cal_open(spec, c.token, c.now, write, own) end
  return cals
end

-- The earliest instant from `gate` (set by limit `by`) the call may start at as far as
-- the concurrency limits `concs` and the aligned limits `cals` say; the index of the
-- limit that set it (lib/call.lua's denied_by, 0: none); and whether that instant is
-- firm (a concurrency turn is only expected: it is confirmed again when it comes).
-- `waiter`: the call holds a turn in line.
local function gate_at(c, concs, cals, gate, by, waiter, write)
  local firm = true
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
  -- a call with one concurrency limit and no other may be handed a turn (conc_hand)
  local handy = #c.concs == 1 and #c.logs == 0 and #c.cals == 0
  for _, cc in ipairs(c.concs) do
    if status == 1 or status == 6 then
      conc_take(cc, c.token, at)
    elseif status == 2 or status == 3 then
      conc_wait(cc, c.token, at, handy)
    end
  end
  if status == 1 or status == 2 or status == 3 or status == 6 then
    for _, cal in ipairs(cals) do cal_count(cal, at, c.now) end
  end
end

return {open_cals = open_cals, at = gate_at, commit = gate_commit, cal_at = cal_at,
  cal_open = cal_open, cal_release = cal_release, cal_settle = cal_settle,
  cal_state = cal_state, conc_release = conc_release, conc_renew = conc_renew,
  conc_handed = conc_handed}
end
