"""Where the limiter's data sits in Redis: the one definition on the Python side.

The scripts write this layout (each ``lua/*.lua`` header states it, and
``tests/test_layout.py`` checks the constants here against the scripts' own). Key names
are built here for ``Limiter``; ``status``, ``explain``, ``reset``, the park and the
tests read Redis through here.

Keys
    ``{prefix}:{tag}:key:{algorithm}:{window_us}``: a limit of ``window_us`` on the
    (escaped) ``key``. ``tag``, in braces, is the key's Redis Cluster hash tag, a
    function of the key alone (``keys.hash_tag``); a key that is its own tag is not
    written twice: ``ratelimit:{api:t1}:log:1000000`` for ``api:t1``,
    ``ratelimit:{yt:K1}:yt:quota:K1:log:1000000`` for ``yt:quota:K1``, however the key
    was reached. :func:`key_base` is the one place a key's names are built. The log's
    pending set (reservations whose task has not started) is that name +
    :data:`PENDING`. A concurrency limit on ``key`` is ``{prefix}:{tag}:key:conc:0``
    (its holders), with its starts and waiters at that name + :data:`STARTS` and +
    :data:`PENDING`. The settings of ``key`` (a pause, a rate override) are the hash
    ``{prefix}:{tag}:key:settings``.
    The park of a broker: ``{prefix}:{park:<digest>}:`` + ``due`` / ``copies`` /
    ``counts``.

The log (``algorithm="log"``), a sorted set
    One entry per granted or reserved call: member = the call's 8-byte token, then
    ``"." + weight`` when the weight is not 1; score = its instant, µs of Redis time.
    Meta members score below :data:`ENTRY_FLOOR`: ``""`` the running total weight,
    ``"+"`` minus the newest entry's instant, ``"="`` the weight every entry has (0 once
    mixed), ``"~"`` minus the instant the key's ``PEXPIRE`` runs out; a paced limit
    (``burst=``) adds :data:`PACE_MEMBER`, minus its pace's theoretical arrival time.

A calendar-aligned limit (``align=``, ``lua/calendar.lua``), a sorted set
    ``{prefix}:{tag}:key:cal:{window_us}``: entries as the log's (score = the instant
    the call counts at); meta member ``"#" + start`` per window holding any, score =
    the weight counted in the window starting at ``start`` (µs); ``"~"`` minus the
    instant the key's expiry was set to.

The counter (``algorithm="counter"``), a hash
    ``w`` the current fixed window's number (instant // window), ``c`` its count, ``p``
    the previous window's count; a paced limit adds :data:`PACE_FIELD`, its pace's
    theoretical arrival time (µs).

A concurrency limit (``lua/lib/concurrency.lua``), three sorted sets
    holders: token -> when its lease runs out (µs), and the meta member ``""`` = the
    average time a body held a slot (µs); starts: token -> when its body started;
    waiters: token -> when its turn is expected. Beside them (``lua/lib/concurrency.lua``,
    a turn handed over): holders + :data:`HANDOFF`, the waiters that may be handed a turn
    (token -> until when), and holders + :data:`HANDOFF` + ``":"`` + the token in hex, a
    list: the end (µs) of the lease of the turn handed to that call.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .keys import escape_key, hash_tag
from .limit import Concurrency, Limit

#: Scores below this are the log's meta members, not entries (entries are instants).
ENTRY_FLOOR = 10**13
#: Bytes of a token, the start of every entry's member.
TOKEN_LEN = 8
#: The log's meta members: total, minus the newest instant, uniform weight, minus expiry.
META_MEMBERS = ("", "+", "=", "~")
#: The counter's hash fields: window number, its count, the previous window's count.
COUNTER_FIELDS = ("w", "c", "p")
#: A paced limit's theoretical arrival time (µs, ``lua/lib/pace.lua``): the log's meta
#: member (scored minus it), and the counter's hash field.
PACE_MEMBER = "^"
PACE_FIELD = "t"
#: Suffix of a log key's pending set, and of a concurrency limit's waiters.
PENDING = ":r"
#: Suffix of a concurrency limit's starts.
STARTS = ":s"
#: Suffixes of a fair limit's log key: its queue of waiting calls' tags (``value|member``
#: -> tag) and its state hash (``""`` -> virtual time, ``"f:" + value`` -> finish tag).
FAIR_TAGS = ":q"
FAIR_STATE = ":v"
#: The meta member of a concurrency limit's holders: the average time a body held a slot.
AVERAGE = ""
#: Suffix of a concurrency limit's holders key naming its handoff keys (see the docstring).
HANDOFF = ":go"
#: Prefix of a calendar key's meta member for a window: ``"#" + its start`` (µs).
WINDOW_META = "#"
#: Field of a key's settings hash: until when (µs) the key is paused.
PAUSE_FIELD = "pause"
#: Field of a key's settings hash: its rate override, "limit window_us until_us" (until
#: 0: until removed).
RATE_FIELD = "rate"
#: Prefix of a settings hash field: what an upstream said of one limit of the key,
#: ``"seen:<algorithm>:<window_us>"`` -> ``"r t l lu"`` (``lua/observe.lua``).
SEEN_FIELD = "seen:"
#: Field of a key's settings hash: 1 once an upstream was observed on the key (its limits'
#: seen and eff fields are read only then).
UP_FIELD = "up"
#: Prefix of a settings hash field: the effective rate of an adapting limit of the key,
#: ``"eff:<algorithm>:<window_us>"`` -> ``"e cut_us step"`` (``lua/lib/settings.lua``).
EFF_FIELD = "eff:"
ALGORITHMS = ("log", "counter", "conc", "cal")

_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")


def key_base(prefix: str, key: str) -> str:
    """The head of every Redis name of the (already escaped) ``key``: the prefix, the
    key's hash tag in braces, then the key unless it is its own tag. Every path builds a
    key's names through here."""
    tag = hash_tag(key)
    return f"{prefix}:{{{tag}}}" if tag == key else f"{prefix}:{{{tag}}}:{key}"


def redis_key(prefix: str, key: str, limit: Limit | Concurrency) -> str:
    """The Redis key of ``limit`` applied to the (already escaped) ``key``."""
    if isinstance(limit, Concurrency):
        return f"{key_base(prefix, key)}:conc:0"
    return f"{key_base(prefix, key)}:{limit.kind}:{limit.fixed_rate.window_us}"


def script_keys(keys: list[str], limits: tuple[Any, ...]) -> list[str]:
    """A script call's KEYS for the limits' Redis ``keys`` (in ``to_limits`` order):
    the sliding rate limits' keys, then (log) each one's pending set, then the aligned
    limits' keys, then each concurrency limit's key and companions, then each limit's
    settings hash."""
    settings = [settings_of(k) for k in keys]
    sliding, aligned, every = [], [], []
    for k, limit in zip(keys, limits, strict=True):
        if isinstance(limit, Concurrency):
            every += [k, *companions(k)]
        elif limit.align is None:
            sliding.append(k)
        else:
            aligned.append(k)
    if sliding and limits[0].algorithm == "log":
        sliding += [k + PENDING for k in sliding]
    return sliding + aligned + every + settings


def settings_of(redis_key: str) -> str:
    """The settings hash of a limit's Redis key."""
    return redis_key.rsplit(":", 2)[0] + ":settings"


def seen_field(redis_key: str) -> str:
    """The settings hash field of what an upstream said of the limit ``redis_key``."""
    algorithm, window = redis_key.rsplit(":", 2)[1:]
    return f"{SEEN_FIELD}{algorithm}:{window}"


def parse_seen(value: bytes | str | None, now: int) -> tuple[int, int, int] | None:
    """``(remaining, reset_us, quota)`` of a :data:`SEEN_FIELD` value at ``now`` (µs):
    the remaining and its reset while before it, the quota while in force (0: none);
    None when neither holds."""
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    remaining, reset, quota, until = (int(part) for part in text.split())
    if reset <= now:
        remaining = reset = 0
    if until <= now:
        quota = 0
    return (remaining, reset, quota) if reset or quota else None


def effective(value: bytes | str, window_us: int, now: int) -> int:
    """The effective limit an :data:`EFF_FIELD` value gives at ``now`` (µs), before the
    declared limit caps it."""
    text = value.decode() if isinstance(value, bytes) else value
    eff, cut, step = (int(part) for part in text.split())
    return eff + (now - cut) // window_us * step


#: The indexes of the keys paused and of those with a rate override (:func:`index_key`).
PAUSED_INDEX = "paused"
OVERRIDES_INDEX = "overrides"


def index_key(prefix: str, which: str) -> str:
    """A sorted set of settings hashes (a key's, :func:`settings_key`) scored by when
    their pause or override ends (µs since the epoch, the writer's clock; ``+inf``: no
    end), so that they are counted without a scan; pruned by their readers. ``which``:
    :data:`PAUSED_INDEX` or :data:`OVERRIDES_INDEX`."""
    return f"{prefix}:{{index}}:{which}"


def settings_key(prefix: str, key: str) -> str:
    """The settings hash (a pause, a rate override) of the (already escaped) ``key``."""
    return f"{key_base(prefix, key)}:settings"


def companions(redis_key: str) -> list[str]:
    """The keys that go with a limit's key: the log's pending set; a concurrency
    limit's starts and waiters."""
    if redis_key.endswith(":conc:0"):
        return [redis_key + STARTS, redis_key + PENDING]
    return [redis_key + PENDING]


def stored_with(redis_key: str) -> list[str]:
    """Every key that goes with a limit's key and goes when it is reset: its
    :func:`companions`, a fair limit's queue (:data:`FAIR_TAGS`, :data:`FAIR_STATE`) and
    a concurrency limit's handoff marks (:data:`HANDOFF`; a handed turn's own list lapses
    with its lease, and is not taken once its holder is gone)."""
    return [
        *companions(redis_key),
        redis_key + FAIR_TAGS,
        redis_key + FAIR_STATE,
        redis_key + HANDOFF,
    ]


def handoff_list(redis_key: str, token: bytes) -> str:
    """The list of the turn of concurrency limit ``redis_key`` handed to the call whose
    token (bytes) is ``token``."""
    return f"{redis_key}{HANDOFF}:{token.hex()}"


@dataclass(frozen=True)
class KeyName:
    """A Redis key split into the logical key, the algorithm and the window."""

    redis_key: str
    key: str
    algorithm: str
    window_us: int


def _split(prefix: str, name: str, parts: int) -> tuple[str, list[str]] | None:
    """``(key, the `parts` segments after it)`` of a Redis name built by :func:`key_base`
    (``{prefix}:{tag}[:key]:a:b``); None if the name is not one of ours."""
    head = f"{prefix}:{{"
    if not name.startswith(head):
        return None
    tag, brace, tail = name[len(head) :].partition("}")
    if not brace or not tail.startswith(":"):
        return None
    pieces = tail[1:].rsplit(":", parts)
    if len(pieces) == parts:
        key = tag  # the key is its own tag
    elif pieces[0] and pieces[0] != tag:
        key = pieces.pop(0)
    else:
        return None
    return (key, pieces) if hash_tag(key) == tag else None


def parse_key(prefix: str, name: str) -> KeyName | None:
    """Split ``{prefix}:{tag}[:key]:{algorithm}:{window_us}``; None if it is not one."""
    found = _split(prefix, name, 2)
    if found is None:
        return None
    key, (algorithm, window) = found
    if algorithm not in ALGORITHMS or not window.isdigit():
        return None
    return KeyName(name, key, algorithm, int(window))


def settings_logical_key(prefix: str, name: str) -> str | None:
    """The key of the settings hash ``name`` (``{prefix}:{tag}[:key]:settings``); None
    if it is not one of ours."""
    found = _split(prefix, name, 1)
    return found[0] if found is not None and found[1] == ["settings"] else None


def key_glob(prefix: str, key: str) -> str:
    """A SCAN pattern for every window and algorithm of ``key`` (as a user gives it)."""
    return f"{_glob(key_base(prefix, escape_key(key)))}:*"


def prefix_glob(prefix: str) -> str:
    """A SCAN pattern for every key under ``prefix``."""
    return f"{_glob(prefix)}:*"


def _glob(text: str) -> str:
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def keys_of(client: Any, prefix: str, key: str) -> list[str]:
    """Every Redis key of ``key`` (all windows and algorithms), sorted."""
    return keys_among(client.scan_iter(key_glob(prefix, key)), prefix, key)


def keys_among(names: Iterable[bytes | str], prefix: str, key: str) -> list[str]:
    """The ``names`` (found by a scan of :func:`key_glob`) that are limits of ``key``."""
    wanted = escape_key(key)
    found = []
    for raw in names:
        name = parse_key(prefix, raw.decode() if isinstance(raw, bytes) else raw)
        if name is not None and name.key == wanted:
            found.append(name.redis_key)
    return sorted(found)


def weight_of(member: bytes) -> int:
    """A log entry's weight: 1, or the number after its token and a dot."""
    return int(member[TOKEN_LEN + 1 :]) if len(member) > TOKEN_LEN else 1


def log_entries(client: Any, key: str, after: int | None = None) -> list[tuple[int, int]]:
    """``(instant_us, weight)`` of the entries of the log ``key`` later than ``after``
    (all if None), oldest first."""
    low = ENTRY_FLOOR if after is None else f"({max(after, ENTRY_FLOOR)}"
    rows = client.zrangebyscore(key, low, "+inf", withscores=True)
    return [(int(score), weight_of(member)) for member, score in rows]


def parse_override(value: bytes | str | None, now: int) -> tuple[int, int, int] | None:
    """``(limit, window_us, until_us)`` of a :data:`RATE_FIELD` value still in force at
    ``now`` (µs; until 0: no end), else None."""
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    limit, window_us, until = (int(part) for part in text.split())
    return (limit, window_us, until) if until == 0 or until > now else None


def pace_due(client: Any, name: KeyName) -> int | None:
    """The theoretical arrival time (µs) of the pace kept in the limit ``name``'s key,
    None when it keeps none (not paced, or no call counted while it was)."""
    if name.algorithm == "counter":
        value = client.hget(name.redis_key, PACE_FIELD)
        return int(value) if value is not None else None
    score = client.zscore(name.redis_key, PACE_MEMBER)
    return -int(score) if score is not None else None


def log_total(client: Any, key: str) -> int:
    """The running total weight the script keeps for the log ``key`` (0 when absent)."""
    score = client.zscore(key, META_MEMBERS[0])
    return int(score) if score is not None else 0
