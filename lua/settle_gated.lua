-- settle_gated.lua — settle.lua for a call with calendar-aligned or concurrency limits:
-- an aligned limit's entry weighs the real cost too (a concurrency limit has no cost).
-- What it does: lib/settle_body.lua, with the functions of lib/gate.lua.
--
-- KEYS, ARGV, flag and reply: settle.lua's.

--- @include "lib/call.lua"
--- @include "lib/log.lua"
--- @include "lib/gate.lua"
--- @include "lib/reply.lua"
--- @include "lib/settle_body.lua"

return settle(read_call(KEYS, ARGV, ARGV[2] == 'log'), ARGV, gate_lib())
