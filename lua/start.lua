-- start.lua — start the call whose token is ARGV[1]: a reserved task that came back for
-- its slot, or a grant whose reply was read late. The start: lib/start_body.lua.
-- Composed for each call as acquire_full.lua is: "+log" with the log's files for
-- sliding limits, "+cal" with lib/calendar.lua for calendar-aligned limits, "+conc"
-- with lib/concurrency.lua for concurrency limits ("start+log+cal+conc").
--
-- KEYS, ARGV and reply: a decision's (lib/call.lua). ARGV[2], the flag:
--   "reserved"  the token is a reservation a message carries (a deferred task). Not
--               before its slot (status 3 until then; 6 within `hold`). A token with an
--               entry in one of its logs but a pending slot in none was started on
--               already (status 5): this is a second delivery of the message, which
--               competes anew. A token with neither (Redis lost it) starts as a late
--               task does. A late task placed anew past the horizon is denied (status
--               0): it holds no slot and competes again.
--   "granted"   the token is this process's own grant, read too late to start on (a
--               busy gevent hub, a descheduled process): started from now as a late
--               reservation is. Its concurrency slots are already held and its key was
--               not paused when it was granted.

--- @include "lib/call.lua"
--- @include "lib/log.lua" if log else "lib/no_log.lua"
--- @include "lib/log_edit.lua" if log
--- @include "lib/log_search.lua" if log
--- @include "lib/calendar.lua" if cal else local calendar = nil
--- @include "lib/concurrency.lua" if conc else local concurrency = nil
--- @include "lib/reply.lua"
--- @include "lib/start_body.lua"

return start(read_call(KEYS, ARGV, true), calendar, concurrency)
