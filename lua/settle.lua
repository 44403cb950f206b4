-- settle.lua — the call ARGV[1], counted at the weights its token carries, now weighs its
-- real cost (0 or more, and it may exceed the limit). A refund frees budget at once; a
-- surcharge may put a window over its limit, which the next calls wait out. Entries
-- keep their instants; one that has left its window, or was never written, is left
-- alone. The counter keeps no entries: the difference is counted in its current window,
-- if the call was counted in it. An aligned limit's entry weighs the real cost too (a
-- concurrency limit has no cost). What it does: lib/settle_body.lua. Composed for each
-- call as acquire_full.lua is: "+log" with lib/log.lua for sliding log limits, "+cal"
-- with lib/cal_edit.lua for calendar-aligned limits ("settle+log+cal").
--
-- KEYS and ARGV: a decision's (lib/call.lua), its costs the real ones, then the weight
-- each rate limit (sliding, then aligned) counted the call at. ARGV[2], the flag: the
-- algorithm of the sliding limits, "log" or "counter".
-- Reply: a decision's, status 7 (0: no entry of the call was found).

--- @include "lib/call.lua"
--- @include "lib/log.lua" if log else "lib/no_log.lua"
--- @include "lib/cal_edit.lua" if cal else local calendar = nil
--- @include "lib/reply.lua"
--- @include "lib/settle_body.lua"

return settle(read_call(KEYS, ARGV, ARGV[2] == 'log'), ARGV, calendar)
