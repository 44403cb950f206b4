-- start_gated.lua — start.lua for a call with calendar-aligned or concurrency limits
-- (besides any sliding ones, or none). The start: lib/start_body.lua, with the
-- functions of lib/gate.lua.
--
-- KEYS, ARGV and reply: a decision's (lib/call.lua). ARGV[2], the flag: start.lua's
-- ("reserved" or "granted").

--- @include "lib/call.lua"
--- @include "lib/log.lua"
--- @include "lib/log_edit.lua"
--- @include "lib/log_search.lua"
--- @include "lib/gate.lua"
--- @include "lib/reply.lua"
--- @include "lib/start_body.lua"

return start(read_call(KEYS, ARGV, true), gate_lib())
