-- release.lua — give back what the call ARGV[1] holds: its reservation (log entries and
-- its pending slots still in the future), for a call whose rate limits are all sliding
-- (release_gated.lua: one with aligned or concurrency limits too). What it does:
-- lib/release_body.lua.
--
-- KEYS and ARGV: a decision's (lib/call.lua). ARGV[2], the flag: the algorithm of the
-- sliding limits, "log" or "counter" (whose windows hold no entry to give back).
-- Reply: a decision's, status 4.

--- @include "lib/call.lua"
--- @include "lib/log.lua"
--- @include "lib/log_edit.lua"
--- @include "lib/reply.lua"
--- @include "lib/release_body.lua"

return release(read_call(KEYS, ARGV, ARGV[2] == 'log'), nil)
