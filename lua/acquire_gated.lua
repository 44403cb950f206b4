-- acquire_gated.lua — acquire.lua for a call with calendar-aligned or concurrency limits
-- (besides any sliding ones, or none: no sliding limit at all is allowed). The
-- decision: lib/acquire_body.lua, with the functions of lib/gate.lua and a fair
-- Concurrency's queue (lib/fair.lua).
--
-- KEYS, ARGV and reply: a decision's (lib/call.lua). ARGV[2], the flag: acquire.lua's
-- ("now", "reserve" or "peek").

--- @include "lib/call.lua"
--- @include "lib/log.lua"
--- @include "lib/log_search.lua"
--- @include "lib/gate.lua"
--- @include "lib/reply.lua"
--- @include "lib/fair.lua"
--- @include "lib/acquire_body.lua"

return acquire(read_call(KEYS, ARGV, true), gate_lib(), fair_place)
