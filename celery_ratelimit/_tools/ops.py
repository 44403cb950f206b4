"""Operations behind both command lines: ``status`` and ``reset KEY`` (``explain TASK``
is in ``explain``, built on these; the text both print is ``report``'s).

Nothing here writes to Redis (``Limiter.reset`` forgets a key). ``status`` reads the keys as they
are (the log's sorted sets, the counter's hashes) and asks the scripts in peek mode,
which count nothing.

A Redis key does not store its limit, only the window (in its name) and what was
counted. ``status`` shows ``used/limit`` for keys that match a limit known from the
app (its tasks' ``ratelimit`` options and ``ratelimit_rules``); for any other key, the
weight used in its window.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any

from redis.exceptions import ResponseError

from .._celery.settings import redis_url, setting
from .._engine.fair import waiting_by_value
from .._engine.keys import escape_key, escape_literal, fixed_key
from .._engine.layout import (
    COUNTER_FIELDS,
    ENTRY_FLOOR,
    PENDING,
    STARTS,
    WINDOW_META,
    KeyName,
    log_entries,
    pace_due,
    parse_key,
    prefix_glob,
)
from .._engine.limit import AnyLimit, Concurrency, Limit, to_limits
from .._engine.limiter import REDIS_ERRORS, Limiter
from .._engine.rate import Rate
from .keysettings import KeySettings, Seen, key_settings
from .keysettings import text as _text

#: Leases of a concurrency key's holders read for its row (the soonest to end).
LEASES_SHOWN = 10

#: What an escaped argument value can look like inside a key (see keys.escape_part).
_VALUE = r"[A-Za-z0-9_.@%#-]+"


# -- limits known from the app -----------------------------------------------------------


@dataclass(frozen=True)
class KnownLimit:
    """A limit the app declares, and which logical keys it can produce."""

    limit: AnyLimit
    pattern: re.Pattern[str]
    source: str

    def matches(self, name: KeyName) -> bool:
        limit = self.limit
        window = 0 if isinstance(limit, Concurrency) else limit.fixed_rate.window_us
        return (
            name.algorithm == limit.kind
            and name.window_us == window
            and self.pattern.fullmatch(name.key) is not None
        )


def _key_pattern(limit: AnyLimit, task_name: str | None) -> re.Pattern[str] | None:
    if isinstance(limit, Limit) and callable(limit.rate):
        return None  # a rate function: which windows it gives cannot be known
    key = limit.key
    if key is None:
        return re.compile(re.escape(escape_key(task_name))) if task_name else None
    if not isinstance(key, str):
        return None  # a key function: which keys it makes cannot be known
    if not limit.fields:
        return re.compile(re.escape(fixed_key(key)))
    return re.compile(
        "".join(
            re.escape(escape_literal(literal)) + (_VALUE if name is not None else "")
            for literal, name, *_ in string.Formatter().parse(key)
        )
    )


def app_tasks(app: Any) -> dict[str, Any]:
    """The app's tasks, after importing its configured modules (``include``, ``imports``)."""
    app.loader.import_default_modules()
    return dict(app.tasks)


def task_limits(task: Any) -> tuple[Limit, ...] | None:
    spec = getattr(task, "ratelimit", None)
    name = getattr(task, "name", "") or ""
    if spec is None or name.startswith("celery."):
        return None
    return to_limits(spec, f"ratelimit of task {name}")


def known_limits(app: Any) -> list[KnownLimit]:
    """Every limit of the app's tasks, plus the ``ratelimit_rules`` limits with plain keys."""
    found: list[KnownLimit] = []
    for name, task in sorted(app_tasks(app).items()):
        for limit in task_limits(task) or ():
            pattern = _key_pattern(limit, name)
            if pattern is not None:
                found.append(KnownLimit(limit, pattern, name))
    for rule, spec in setting("ratelimit_rules", app).items():
        for limit in to_limits(spec, f"ratelimit_rules[{rule!r}]"):
            pattern = _key_pattern(limit, None)
            if pattern is not None:
                found.append(KnownLimit(limit, pattern, f"rule {rule}"))
    return found


def limiter_for_app(app: Any) -> Limiter:
    return Limiter.from_url(redis_url(app), prefix=setting("ratelimit_key_prefix", app))


def guard_for_app(app: Any) -> float:
    return float(setting("ratelimit_guard", app))


# -- status ------------------------------------------------------------------------------


@dataclass
class KeyStatus:
    """One Redis key as it is now.

    ``used`` is the weight counted in the window up to now (for the counter, the
    algorithm's estimate), ``reserved`` the weight of reservations (future entries)
    and ``reservations`` their number. With a known ``limit``: ``remaining`` (counting
    reservations) and ``next_free`` (seconds until a call of cost 1 fits, from a peek);
    ``override``: the key's rate override of this window, in force (``Limiter.override``).
    ``pace_in``: for a paced limit (``burst=``), seconds until one more unit conforms to
    its pace (0: now), from the pace the key keeps.
    ``waiting``: on a fair limit's key, how many calls of each fair-key value wait.
    ``drains_in``: seconds until the last reservation's slot (the log), or the last
    waiting call's expected turn (a concurrency key): when the backlog has drained.
    ``leases``: on a concurrency key, seconds left on the leases of the bodies holding
    a slot, the soonest first (at most :data:`LEASES_SHOWN`).
    """

    name: KeyName
    used: int
    reserved: int = 0
    reservations: int = 0
    limit: AnyLimit | None = None
    sources: list[str] = field(default_factory=list)
    remaining: int | None = None
    next_free: float | None = None
    oldest_leaves: float | None = None
    ttl: float | None = None
    override: Rate | None = None
    pace_in: float | None = None
    waiting: dict[str, int] = field(default_factory=dict)
    drains_in: float | None = None
    leases: list[float] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The row as ``status --json`` prints it: numbers in seconds, None unknown."""
        limit = self.limit
        most = None
        if isinstance(limit, Concurrency):
            most = limit.n
        elif limit is not None:
            most = self.override.limit if self.override else limit.fixed_rate.limit
        elif self.override is not None:
            most = self.override.limit
        return {
            "key": self.name.key,
            "redis_key": self.name.redis_key,
            "algorithm": self.name.algorithm,
            "window_s": self.name.window_us / 1_000_000,
            "used": self.used,
            "limit": most,
            "declared": limit.label if limit is not None else None,
            "sources": self.sources,
            "remaining": self.remaining,
            "reserved": self.reserved,
            "reservations": self.reservations,
            "next_free_s": self.next_free,
            "drains_in_s": self.drains_in,
            "override": str(self.override) if self.override else None,
            "waiting": self.waiting,
            "leases_s": self.leases,
        }


def pace_in(
    client: Any, name: KeyName, limit: AnyLimit, now: int, rate: Rate | None
) -> float | None:
    """Seconds until a unit more conforms to the pace of ``limit`` (at its ``rate``, an
    override, when given) kept in the key ``name``; None when it is not paced."""
    if not isinstance(limit, Limit) or limit.burst is None:
        return None
    rate = rate or limit.fixed_rate
    tat = pace_due(client, name)
    if tat is None:
        return 0.0
    interval = -(-rate.window_us // rate.limit)
    due = tat - (min(limit.burst, rate.limit) - 1) * interval
    return max(due - now, 0) / 1_000_000


def server_now_us(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def log_status(client: Any, name: KeyName, now: int) -> KeyStatus:
    status = KeyStatus(name, used=0)
    oldest = None
    for score, weight in log_entries(client, name.redis_key, after=now - name.window_us):
        if score > now:
            status.reserved += weight
            status.reservations += 1
            status.drains_in = max(status.drains_in or 0.0, (score - now) / 1_000_000)
        else:
            status.used += weight
            oldest = score if oldest is None else min(oldest, score)
    if oldest is not None:
        status.oldest_leaves = (oldest + name.window_us - now) / 1_000_000
    if status.reservations:
        status.waiting = waiting_by_value(client, name.redis_key)
    return status


def concurrency_status(client: Any, name: KeyName, now: int) -> KeyStatus:
    """Bodies holding a slot (``used``) and calls waiting for their turn."""
    key = name.redis_key
    waiting = client.zcard(key + PENDING)
    status = KeyStatus(
        name, used=client.zcard(key + STARTS), reserved=waiting, reservations=waiting
    )
    last = client.zrange(key + PENDING, -1, -1, withscores=True)
    if last:
        status.drains_in = max(int(last[0][1]) - now, 0) / 1_000_000
    held = client.zrangebyscore(
        key, ENTRY_FLOOR, "+inf", start=0, num=LEASES_SHOWN, withscores=True
    )  # past the meta member (the average hold), which scores below the floor
    status.leases = [max(int(ends) - now, 0) / 1_000_000 for _, ends in held]
    return status


def calendar_status(client: Any, name: KeyName, now: int) -> KeyStatus:
    """A calendar-aligned key: the weight counted in the window holding ``now`` (the
    latest one begun) and in windows still to come (reservations)."""
    metas = client.zrangebyscore(name.redis_key, "-inf", f"({ENTRY_FLOOR}", withscores=True)
    names = [(m.decode() if isinstance(m, bytes) else m, int(w)) for m, w in metas]
    windows = sorted(
        (int(name[len(WINDOW_META) :]), weight)
        for name, weight in names
        if name.startswith(WINDOW_META)
    )
    begun = [weight for start, weight in windows if start <= now]
    status = KeyStatus(name, used=begun[-1] if begun else 0)
    status.reserved = sum(weight for start, weight in windows if start > now)
    status.reservations = client.zcount(name.redis_key, f"({now}", "+inf")
    return status


def override_in_force(override: Rate | None, name: KeyName, alone: bool) -> Rate | None:
    """``override`` when the decisions on the limit ``name`` apply it, as the scripts
    do (``lua/lib/call.lua``): to a rate limit of its window, or of any window when the
    limit is the only rate limit of its key and not calendar-aligned."""
    if override is None or name.algorithm == "conc":
        return None
    if override.window_us == name.window_us or (alone and name.algorithm != "cal"):
        return override
    return None


def key_status(client: Any, name: KeyName, now: int, override: Rate | None = None) -> KeyStatus:
    """The state of one limit's key, whatever its algorithm; counted over the window of
    ``override`` (one in force: see :func:`override_in_force`) when given."""
    if override is not None and override.window_us != name.window_us:
        row = key_status(client, replace(name, window_us=override.window_us), now)
        row.name, row.override = name, override
        return row
    read = {
        "log": log_status,
        "counter": counter_status,
        "conc": concurrency_status,
        "cal": calendar_status,
    }
    row = read[name.algorithm](client, name, now)
    row.override = override
    return row


def counter_status(client: Any, name: KeyName, now: int) -> KeyStatus:
    w, c, p = client.hmget(name.redis_key, *COUNTER_FIELDS)
    window = name.window_us
    wid = now // window
    current = float(c or 0)
    previous = float(p or 0)
    stored = int(w) if w is not None else None
    if stored is None or stored < wid - 1:
        current = previous = 0.0
    elif stored == wid - 1:
        current, previous = 0.0, current
    elapsed = now - wid * window
    estimate = previous * (window - elapsed) / window + current
    return KeyStatus(name, used=int(-(-estimate // 1)))


#: How ``status`` can order its rows (``--sort``): by key, by the backlog's drain time
#: (the longest first), by the share of the limit used (the fullest first).
SORTS = ("key", "backlog", "used")


def sort_rows(rows: list[KeyStatus], by: str) -> list[KeyStatus]:
    """``rows`` in the order ``by`` names (one of :data:`SORTS`)."""
    if by == "backlog":
        return sorted(rows, key=lambda r: (-(r.drains_in or 0.0), -r.reservations))
    if by == "used":
        return sorted(rows, key=lambda r: -_share(r))
    return rows


def _share(row: KeyStatus) -> float:
    most = row.as_json()["limit"]
    return row.used / most if most else 0.0


def status(
    limiter: Limiter,
    known: Sequence[KnownLimit] = (),
    *,
    guard: float = 0.0,
    match: str | None = None,
) -> list[KeyStatus]:
    """The state of every key under the limiter's prefix (or under ``match``, a key glob).

    ``match`` is a glob over logical keys (``"yt:*"``).

    Raises:
        LimiterUnavailable / LimiterMisconfigured: Redis failed (see ``failures``).
    """
    client = limiter.client
    overrides = {row.key: row.override for row in key_settings(limiter, match) if row.override}
    try:
        now = server_now_us(client)
        names = [
            name
            for k in client.scan_iter(prefix_glob(limiter.prefix))
            if (name := parse_key(limiter.prefix, _text(k))) is not None
            and (match is None or fnmatchcase(name.key, match))
        ]
        return read_rows(limiter, names, known, now, overrides, guard=guard)
    except REDIS_ERRORS as exc:
        raise limiter.translate(exc, "a status read") from exc


def read_rows(
    limiter: Limiter,
    names: Sequence[KeyName],
    known: Sequence[KnownLimit],
    now: int,
    overrides: Mapping[str, Rate | None],
    *,
    guard: float = 0.0,
) -> list[KeyStatus]:
    """The rows of the limits ``names`` that hold anything at ``now`` (µs of Redis
    time), sorted by key: ``status``'s reading, for the keys a scan found (all of
    them for ``status``, a page of them for the operator's page). ``overrides``: each
    logical key's rate override in force.

    Raises:
        redis errors, as they come (the caller translates them).
    """
    client = limiter.client
    result = []
    names = sorted(names, key=lambda n: (n.key, n.window_us, n.algorithm))
    rated = Counter(n.key for n in names if n.algorithm != "conc")
    for name in names:
        override = override_in_force(overrides.get(name.key), name, rated[name.key] == 1)
        try:
            row = key_status(client, name, now, override)
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            continue  # a name of our shape holding another type: not the limiter's
        if row.used == 0 and row.reserved == 0:
            continue  # everything in it has left the window: the key is idle
        ttl = client.pttl(name.redis_key)
        row.ttl = ttl / 1000 if ttl and ttl > 0 else None
        matching = [k for k in known if k.matches(name)]
        if matching:
            row.limit = matching[0].limit
            sources = {k.source for k in matching}
            # a task limited by a rule of its exact name is that rule: named once
            row.sources = sorted(s for s in sources if f"rule {s}" not in sources)
            decision = limiter.peek((), (row.limit,), guard=guard, redis_keys=[name.redis_key])
            row.remaining = decision.remaining
            row.next_free = decision.retry_after
            row.pace_in = pace_in(client, name, row.limit, now, row.override)
        result.append(row)
    return result


__all__ = [
    "LEASES_SHOWN",
    "KeyName",
    "KeySettings",
    "KeyStatus",
    "KnownLimit",
    "Seen",
    "key_settings",
    "key_status",
    "known_limits",
    "pace_in",
    "read_rows",
    "sort_rows",
    "status",
]
