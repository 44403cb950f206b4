-- lib/calendar.lua — a decision's calendar-aligned limits (Limit(align=...)): the
-- earliest instant a call fits their windows, and the call counted in one (the key and
-- the rules: lib/cal_keys.lua). Included only in the script of a call that declares
-- aligned limits (a release or a settle includes lib/cal_edit.lua): the file defines one
-- local, `calendar`, the table of the functions the bodies call (the rest are local to
-- its block).

local calendar
do
--- @include "lib/cal_keys.lua"

local CAL_KEEP_MS = 1000

local function cal_fits(cal, j)
  return cal.own == j or cal_used(cal, j) + cal.cost <= cal.limit
end

-- The earliest instant from s at which the call fits every aligned limit of `cals`,
-- and the index (among them) of the last one that moved it (0: none). Gives up (returns
-- the instant reached) past `horizon` from now.
local function cal_at(cals, s, now, horizon)
  local by, moved = 0, true
  while moved do
    moved = false
    for a, cal in ipairs(cals) do
      local j = cal_index(cal, s)
      while not cal_fits(cal, j) do
        j = j + 1
        s, by, moved = cal_start(cal, j), a, true
        if s - now > horizon then return s, by end
      end
    end
  end
  return s, by
end

-- Count the call at instant `at`, moving its entry from another window if it has one.
local function cal_count(cal, at, now)
  local j = cal_index(cal, at)
  local write = {at, cal.member}
  if cal.own ~= j then
    if cal.own and cal.own >= cal.cur then cal_add(cal, cal.own, -cal.cost) end
    local name = cal_name(cal, j)
    cal.counts[name] = cal_used(cal, j) + cal.cost
    write[3], write[4] = cal.counts[name], name
    cal.own = j
  end
  local till = cal_start(cal, j + 1) + CAL_KEEP_MS * 1000
  if till > cal.expiry then
    write[#write + 1], write[#write + 2] = -till, '~'
    redis.call('ZADD', cal.key, unpack(write))
    redis.call('PEXPIRE', cal.key, math.ceil((till - now) / 1000))
    cal.expiry = till
  else
    redis.call('ZADD', cal.key, unpack(write))
  end
end

-- The states of the call `c`'s aligned limits (lib/call.lua), as cal_open gives them.
local function cal_open_all(c, write, own)
  local cals = {}
  for j, spec in ipairs(c.cals) do cals[j] = cal_open(spec, c.token, c.now, write, own) end
  return cals
end

-- The earliest instant from `gate` (set by limit `by`, lib/call.lua's denied_by) at which
-- the call `c` fits its aligned limits `cals`, and the index of the limit that set it.
local function cal_gate(c, cals, gate, by)
  local s, a = cal_at(cals, gate, c.now, c.horizon)
  if s > gate then gate, by = s, #c.logs + a end
  return gate, by
end

-- Count the call in the window holding `at` when the answer `status` (lib/call.lua)
-- counts it: a start, or a reservation.
local function cal_commit(cals, status, at, now)
  if status == 1 or status == 2 or status == 3 or status == 6 then
    for _, cal in ipairs(cals) do cal_count(cal, at, now) end
  end
end

calendar = {open_all = cal_open_all, gate = cal_gate, commit = cal_commit, state = cal_state}
end
