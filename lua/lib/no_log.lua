-- lib/no_log.lua — what stands in for lib/log.lua (with lib/pace.lua),
-- lib/log_search.lua and lib/log_edit.lua in the script of a call with no sliding log
-- (concurrency or aligned limits only, or counters): the names of their functions,
-- which the bodies and lib/fair.lua call only for each of the call's logs, of which it
-- has none (or, for a counter's release or settle, only when its flag is "log"); and the
-- placement of a call, which with no log only its other limits (`push`) decide.

local log_open, log_add, log_flush, log_pend, log_keep_ms, log_move, log_remove
local log_free_at, log_start_in, log_abandoned, pace_at, pace_window

local function logs_place(_, at, by, _, push)
  if push then return push(at, by) end
  return at, by
end
