-- lib/cal_edit.lua — a release's or a settle's calendar-aligned limits
-- (Limit(align=...)): the call's entry given back, or weighing its real cost (the key
-- and the rules: lib/cal_keys.lua). Included only in release.lua's and settle.lua's
-- script of a call that declares aligned limits: the file defines one local, `calendar`,
-- the table of the functions the bodies call (the rest are local to its block).

local calendar
do
--- @include "lib/cal_keys.lua"

-- Give back the call's entry if it still lies ahead (a release).
local function cal_release(cal, now)
  if cal.own and cal.own_at > now then
    if cal.own >= cal.cur then cal_add(cal, cal.own, -cal.cost) end
    redis.call('ZREM', cal.key, cal.member)
    cal.own = nil
  end
end

-- The call's entry, counted at weight `was`, now weighs its cost; its window's weight
-- follows if the window has not ended. True if the entry was found.
local function cal_settle(cal, was, token)
  local old = was == 1 and token or token .. '.' .. was
  local s = redis.call('ZSCORE', cal.key, old)
  if not s then return false end
  s = tonumber(s)
  redis.call('ZREM', cal.key, old)
  redis.call('ZADD', cal.key, s, cal.member)
  local j = cal_index(cal, s)
  if j >= cal.cur then cal_add(cal, j, cal.cost - was) end
  return true
end

calendar = {open = cal_open, release = cal_release, settle = cal_settle, state = cal_state}
end
