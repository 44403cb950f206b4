-- lib/reply.lua — a decision's reply (see lib/call.lua), folded from the state of every
-- limit of the call.

-- The reply, with `remaining` and `reset_after` folded from every limit's state:
-- `logs` (lib/log.lua), `cals` (read with `lib`, lib/cal_keys.lua's cal_state, when
-- there are any) and `concs`; the counter gives its own (`counted`: {remaining, reset}
-- or nil).
local function reply(status, at, retry_after, denied_by, now, logs, lib, cals, concs, counted)
  local remaining, reset = nil, 0
  if counted then remaining, reset = counted[1], counted[2] end
  for _, k in ipairs(logs) do
    local free = k.limit - k.total
    if remaining == nil or free < remaining then remaining = free end
    if k.total > 0 and k.newest + k.window - now > reset then reset = k.newest + k.window - now end
  end
  for _, cal in ipairs(cals) do
    local free, r = lib.state(cal, now)
    if remaining == nil or free < remaining then remaining = free end
    if r > reset then reset = r end
  end
  for _, cc in ipairs(concs) do
    local free = math.max(cc.free, 0)
    if remaining == nil or free < remaining then remaining = free end
  end
  if remaining == nil or remaining < 0 then remaining = 0 end
  return {status, remaining, math.max(retry_after, 0), reset, denied_by, at}
end
