-- lib/pace.lua — even pacing of a sliding limit, Limit(rate, burst=N): the generic cell
-- rate algorithm (GCRA). Functions of a pace table `p`, which pace_open returns:
--   burst       cost units that may start at once (at most the limit)
--   interval    the emission interval, µs: ceil(W / L), so never faster than L per W
--   tat         the theoretical arrival time, µs: when the units counted so far would
--               all have been emitted at one per interval
--
-- The state is one number per limit (O(1)), read and written by the limit's own
-- commands, no extra one: in the log, the meta member PACE_MEMBER scored minus the tat
-- (below lib/log.lua's ENTRY_FLOOR, as its other meta members; read by its ZMSCORE,
-- written by the entry's own ZADD); in the counter's hash, the field PACE_FIELD (read
-- by its HMGET, written by its HSET). A call of cost c conforms from
--     tat - max(burst - c, 0) * interval
-- on (a call costing more than the burst runs alone, once the pace has caught up), and
-- counting it at s moves the tat to max(tat, s) + c * interval. That instant is
-- monotone: a call that conforms at s conforms at every later instant, so the earliest
-- instant that fits both the window and the pace is the later of the two, and
-- retry_after stays exact. The tat is at most one window past the call's entry, which
-- the key outlives: a key expired or pruned away held a tat already past.

local PACE_MEMBER = '^'
local PACE_FIELD = 't'

-- The pace of the limit `spec` (lib/call.lua, after read_settings: an override or an
-- effective rate paces at its own rate) whose stored tat is `stored` (nil: none); nil
-- when the limit is not paced.
local function pace_open(spec, stored)
  if not spec.burst then return nil end
  return {burst = math.min(spec.burst, spec.limit), interval = math.ceil(spec.window / spec.limit),
    tat = tonumber(stored or 0)}
end

-- The earliest instant from `now` at which a call of `cost` conforms to the pace `p`
-- (now when `p` is nil).
local function pace_at(p, cost, now)
  if not p then return now end
  return math.max(now, p.tat - math.max(p.burst - cost, 0) * p.interval)
end

-- The log k (lib/log.lua) of a paced limit seen as a window of one interval holding at
-- most the burst (or the call's cost, when above it): where lib/log_search.lua's
-- log_start_in checks a start against what really started, so that starts stay paced
-- when copies come late (their slots were).
local function pace_window(k)
  return {key = k.key, pending = k.pending, member = k.member, unit = k.unit, cost = k.cost,
    limit = math.max(k.pace.burst, k.cost), exact = k.pace.interval}
end

-- Count a call of `cost` at instant `at` in the pace `p`: its new tat, as a string of
-- all its digits to store (`sign`: '-' for a score that is minus it, else ''; the
-- caller writes it with its own command).
local function pace_take(p, cost, at, sign)
  local tat = p.tat
  if at > tat then tat = at end
  tat = tat + cost * p.interval
  p.tat = tat
  return string.format(sign .. '%.0f', tat)
end
