-- counter.lua — count a call now against every limit of its key, all or nothing, by the
-- approximate sliding window (two fixed-window counters, O(1) memory per key), for a
-- call whose sliding limits are counters. The counter reserves nothing: a call is
-- counted now or denied with the time until it fits. The decision:
-- lib/counter_body.lua. Composed for each call as acquire_full.lua is: "+cal" with
-- lib/calendar.lua for calendar-aligned limits, "+conc" with lib/concurrency.lua for
-- concurrency limits besides its counters, "+pace" with lib/pace.lua when a counter is
-- paced ("counter+pace+cal+conc").
--
-- KEYS and ARGV: a decision's (lib/call.lua), with no pending sets. Each sliding
-- limit's key is a hash: w = the current fixed window's number (now // window), c = the
-- weight counted in it, p = the weight counted in the window before. ARGV[2], the flag:
-- "peek" writes nothing; anything else counts the call now or denies it.
-- Reply: a decision's (status 0 or 1).

--- @include "lib/call.lua"
--- @include "lib/seen.lua"
--- @include "lib/pace.lua" if pace else "lib/no_pace.lua"
--- @include "lib/calendar.lua" if cal else local calendar = nil
--- @include "lib/concurrency.lua" if conc else local concurrency = nil
--- @include "lib/reply.lua"
--- @include "lib/counter_body.lua"

return counter(read_call(KEYS, ARGV, false), calendar, concurrency)
