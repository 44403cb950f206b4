-- lib/no_pace.lua — what stands in for lib/pace.lua in the script of a call with no
-- paced limit, or of a release or a settle (which never move a pace): no limit opens
-- with a pace, and a call conforms to none at once. The storage names are pace.lua's.

local PACE_MEMBER = '^'
local PACE_FIELD = 't'
local pace_window, pace_take
local function pace_open() return nil end
local function pace_at(_, _, now) return now end
