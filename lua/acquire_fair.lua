-- acquire_fair.lua — acquire.lua for a reservation of a fair limit (Limit(fair_key=...)):
-- a call that waits takes its place among the waiting calls of its key (lib/fair.lua).
-- Its rate limits are all sliding logs (acquire_gated.lua: a call with aligned or
-- concurrency limits too). The decision: lib/acquire_body.lua.
--
-- KEYS, ARGV and reply: a decision's (lib/call.lua), with a fair queue. ARGV[2], the
-- flag: "reserve" (acquire.lua's).

--- @include "lib/call.lua"
--- @include "lib/log.lua"
--- @include "lib/log_search.lua"
--- @include "lib/reply.lua"
--- @include "lib/fair.lua"
--- @include "lib/acquire_body.lua"

return acquire(read_call(KEYS, ARGV, true), nil, fair_place)
