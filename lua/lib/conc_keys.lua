-- lib/conc_keys.lua — at most `most` bodies at once per key (Concurrency(n)): the keys of
-- a concurrency limit and what lib/concurrency.lua (a decision's turns) and
-- lib/conc_release.lua (a release) share, functions of a limit's state table `cc` ({h,
-- s, w, most, lease, free}, lib/call.lua). Included inside their block.
--
-- Three sorted sets per limit:
--   holders  token -> the instant its lease runs out (µs); meta member "" (scored below
--            ENTRY_FLOOR) = the average time a body held a slot (µs)
--   starts   token -> the instant its body started (µs)
--   waiters  token -> the instant its turn is expected (µs): denied calls that reserved
--            a turn, in order; one later than its turn by more than GRACE gives its turn
--            up (its task competes afresh if it ever comes)
--   holders .. ":go"  token -> until when (µs) a waiter may be handed a turn: the
--            waiters whose call has no other limit (see conc_hand)
--   holders .. ":go:" .. the token in hex  a list: the end of the lease of the turn
--            handed to that waiter (µs)
--
-- A turn handed over: a body that ends gives its slot, in the same script call, to the
-- first waiter in line (in fair order for a fair limit: lib/fair.lua ordered the line)
-- if that waiter may take one. The waiter holds the slot at once, on a short lease (its
-- expected turn + GRACE), and its handoff list says so: its worker, blocked on that list
-- (BLPOP) or confirming, starts the body without a second decision. A worker that died
-- meanwhile loses the turn when that lease runs out, as a lost holder's slot comes back.
--
-- A call may start when fewer than `most` bodies hold a slot besides the waiters whose
-- turn has come before it. Otherwise its turn: the n-th waiter in line (from 0) gets
-- lane n % most, after n // most bodies of the average time ahead of it there; a lane
-- is free when its holder's body is expected to end. Turns keep their order, so a queue
-- of waiters comes back one by one, not all at once.

local GRACE = 2000000
-- Keys are kept this long (ms) after a write, with the average time they have learnt.
local KEEP_MS = 86400000
local HANDOFF = ':go'

-- A call's token in hex, as its Decision gives it.
local function conc_hex(token)
  return (token:gsub('.', function(ch) return string.format('%02x', string.byte(ch)) end))
end

-- The handoff list of the call `token` under cc.
local function conc_go(cc, token)
  return cc.h .. HANDOFF .. ':' .. conc_hex(token)
end

-- Keep cc's keys for KEEP_MS more (and its lease).
local function conc_keep(cc)
  for _, key in ipairs({cc.h, cc.s, cc.w, cc.h .. HANDOFF}) do
    redis.call('PEXPIRE', key, KEEP_MS + math.ceil(cc.lease / 1000))
  end
end
