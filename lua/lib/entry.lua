-- lib/entry.lua — how a call is written in a limit's sorted set (a sliding log, an
-- aligned limit's windows, a concurrency limit's holders): its member is the call's
-- token (TOKEN_LEN bytes), then "." .. its weight when that is not 1; its score, an
-- instant in µs, is at least ENTRY_FLOOR. Members scoring below ENTRY_FLOOR are the
-- set's meta members (lib/log.lua), which range scans from ENTRY_FLOOR never see.

local ENTRY_FLOOR = 1e13
local TOKEN_LEN = 8

-- An instant as a score bound: all its digits, never an exponent.
local function us(x)
  return string.format('%.0f', x)
end

-- The weight the entry `member` counts for.
local function weight_of(member)
  if #member > TOKEN_LEN then return tonumber(string.sub(member, TOKEN_LEN + 2)) end
  return 1
end
