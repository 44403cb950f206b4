-- release_gated.lua — release.lua for a call with calendar-aligned or concurrency limits:
-- it also gives back its aligned-window entries still in the future, and its
-- concurrency slots or turns in line (its body has ended, or will not run). A slot a
-- body gives back goes to the first waiter in line, in this call (lib/concurrency.lua,
-- conc_hand). What it does: lib/release_body.lua, with the functions of lib/gate.lua.
--
-- KEYS, ARGV and flag: release.lua's. Reply: a decision's, status 4, then the token of
-- each waiter handed a slot (its caller calls that waiter's copy in: park.lua, expedite).

--- @include "lib/call.lua"
--- @include "lib/log.lua"
--- @include "lib/log_edit.lua"
--- @include "lib/gate.lua"
--- @include "lib/reply.lua"
--- @include "lib/release_body.lua"

return release(read_call(KEYS, ARGV, ARGV[2] == 'log'), gate_lib())
