-- acquire.lua — count a call now against every limit of its key, all or nothing, for a
-- call whose rate limits are all sliding logs (acquire_fair.lua: a reservation of a fair
-- limit; acquire_gated.lua: a call with aligned or concurrency limits too). The
-- decision: lib/acquire_body.lua.
--
-- KEYS, ARGV and reply: a decision's (lib/call.lua). ARGV[2], the flag:
--   "now"      count it now, or deny (status 1 or 0)
--   "reserve"  count it now, else at the earliest instant it fits, no further ahead
--              than the horizon: a reservation (status 2, its slot also kept in the
--              pending sets; or 6 when that instant is within `hold`), else deny
--   "peek"     answer as "now" would, writing nothing

--- @include "lib/call.lua"
--- @include "lib/log.lua"
--- @include "lib/log_search.lua"
--- @include "lib/reply.lua"
--- @include "lib/acquire_body.lua"

return acquire(read_call(KEYS, ARGV, true), nil, nil)
