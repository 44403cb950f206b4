-- lib/seen.lua — what an upstream said is left of a limit (lib/call.lua, read_settings,
-- puts such limits in c.seen), taken by a call counted: acquire_full.lua and
-- counter.lua only.

-- Take the call's cost from what the upstream said is left of each limit in c.seen
-- (read_settings), when the instant `at` the call counts at comes before its reset.
local function seen_take(c, at)
  if not c.seen then return end
  for _, spec in ipairs(c.seen) do
    local b = spec.seen
    if at < b.t then
      b.r = math.max(b.r - spec.cost, 0)
      redis.call('HSET', b.key, b.field, string.format('%.0f %.0f %.0f %.0f', b.r, b.t, b.l, b.lu))
    end
  end
end
