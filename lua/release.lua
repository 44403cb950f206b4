-- release.lua — give back what the call ARGV[1] holds: its reservation (log entries and
-- its pending slots still in the future), its aligned-window entries still in the
-- future, and its concurrency slots or turns in line (its body has ended, or will not
-- run). A slot a body gives back goes to the first waiter in line, in this call
-- (lib/conc_release.lua, conc_hand). What it does: lib/release_body.lua.
-- Composed for each call as acquire_full.lua is: "+log" with the log's files for
-- sliding log limits, "+cal" with lib/cal_edit.lua for calendar-aligned limits, "+conc"
-- with lib/conc_release.lua for concurrency limits ("release+log+cal+conc").
--
-- KEYS and ARGV: a decision's (lib/call.lua). ARGV[2], the flag: the algorithm of the
-- sliding limits, "log" or "counter" (whose windows hold no entry to give back).
-- Reply: a decision's, status 4, then the token of each waiter handed a slot (its caller
-- calls that waiter's copy in: park.lua, expedite).

--- @include "lib/call.lua"
--- @include "lib/log.lua" if log else "lib/no_log.lua"
--- @include "lib/log_edit.lua" if log
--- @include "lib/cal_edit.lua" if cal else local calendar = nil
--- @include "lib/conc_release.lua" if conc else local concurrency = nil
--- @include "lib/reply.lua"
--- @include "lib/release_body.lua"

return release(read_call(KEYS, ARGV, ARGV[2] == 'log'), calendar, concurrency)
