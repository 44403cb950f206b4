-- counter_gated.lua — counter.lua for a call with calendar-aligned or concurrency limits
-- besides its counters. The decision: lib/counter_body.lua, with the functions of
-- lib/gate.lua.
--
-- KEYS, ARGV and reply: counter.lua's.

--- @include "lib/call.lua"
--- @include "lib/pace.lua"
--- @include "lib/gate.lua"
--- @include "lib/reply.lua"
--- @include "lib/counter_body.lua"

return counter(read_call(KEYS, ARGV, false), gate_lib())
