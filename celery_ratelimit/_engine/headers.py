"""What an upstream's rate-limit response headers say, read without Redis.

Families understood (header names are matched case-insensitively):

- ``Retry-After``: seconds or an HTTP-date (a pause).
- IETF ``RateLimit`` / ``RateLimit-Policy``: the draft-08+ items
  (``"default";r=50;t=30`` with ``"default";q=100;w=60``, ``l=`` for the quota in
  draft-08), the draft-07 dictionary (``limit=100, remaining=50, reset=30`` with
  ``100;w=60``) and the draft-06 trio ``RateLimit-Limit/-Remaining/-Reset``.
- ``X-RateLimit-Limit/-Remaining/-Reset`` (GitHub and many others): the reset is delta
  seconds, or epoch seconds when above :data:`EPOCH_FLOOR` (milliseconds above
  :data:`EPOCH_MS_FLOOR`).
- LLM APIs' ``x-ratelimit-limit/remaining/reset-requests`` and ``-tokens`` (resets as
  Go durations: ``6m0s``, ``1s``, ``20ms``).

The first three give a budget in *requests*, the last a requests budget and a *tokens*
one. A reset stated in whole seconds (``30``, an epoch second, ``6m0s``) is taken as the
upstream rounding it up: the real reset may come up to a second earlier
(:attr:`Budget.early`). A value that cannot be read is left out with one DEBUG line per
header set; it never raises: a body's call to the upstream already happened.
"""

from __future__ import annotations

import email.utils
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("celery_ratelimit")

#: A reset above this is an instant (epoch seconds), not a number of seconds from now.
EPOCH_FLOOR = 1e9
#: ... and above this, epoch milliseconds.
EPOCH_MS_FLOOR = 1e12
#: A reset (or a pause) further ahead than this is taken as this: no upstream quota
#: resets more than a day ahead without being a typo or a clock gone wrong.
MAX_RESET = 86_400.0

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|h|m|s)")
#: A reset in whole seconds: an integer (delta or epoch seconds), or a duration of whole
#: hours, minutes and seconds.
_WHOLE = re.compile(r"\d+|(?:\d+h)?(?:\d+m)?(?:\d+s)?")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Budget:
    """``remaining`` units are left until ``reset`` seconds from now; ``limit`` units per
    ``window`` seconds (None: not said) is the upstream's quota; the reset may come up to
    ``early`` seconds before ``reset`` (1.0: it was stated in whole seconds, rounded up)."""

    remaining: int
    reset: float
    limit: int | None = None
    window: float | None = None
    early: float = 0.0


@dataclass(frozen=True)
class Observation:
    """What one response's headers say: a pause (seconds) and budgets in requests and
    in tokens (None: not said)."""

    retry_after: float | None = None
    requests: Budget | None = None
    tokens: Budget | None = None

    def __bool__(self) -> bool:
        return self.retry_after is not None or self.requests is not None or self.tokens is not None


def header_map(headers: Any) -> dict[str, str]:
    """``headers`` (a dict, a list of pairs, a requests/httpx/email headers object) as
    lower-cased names to values; a repeated name's values joined by ``", "`` (an HTTP
    list field's meaning).

    Raises:
        TypeError: anything else, naming it.
    """
    if isinstance(headers, Mapping) or hasattr(headers, "items"):
        pairs: Iterable[Any] = headers.items()
        multi = getattr(headers, "multi_items", None)  # httpx keeps repeats apart
        if callable(multi):
            pairs = multi()
    elif isinstance(headers, Iterable) and not isinstance(headers, (str, bytes)):
        pairs = headers
    else:
        raise TypeError(
            f"headers must be a mapping or a list of (name, value) pairs, got {headers!r}"
        )
    found: dict[str, str] = {}
    for pair in pairs:
        try:
            name, value = pair
        except (TypeError, ValueError):
            raise TypeError(f"not a (name, value) header pair: {pair!r}") from None
        name = (name.decode("latin-1") if isinstance(name, bytes) else str(name)).lower()
        text = (value.decode("latin-1") if isinstance(value, bytes) else str(value)).strip()
        found[name] = f"{found[name]}, {text}" if name in found else text
    return found


def parse(headers: Any, now: float | None = None) -> Observation:
    """The :class:`Observation` ``headers`` make, ``now`` being the time they were
    received (epoch seconds; default: this machine's clock).

    Raises:
        TypeError: ``headers`` is not headers (see :func:`header_map`).
    """
    fields = header_map(headers)
    clock = time.time() if now is None else now
    notes: list[str] = []
    pause = _retry_after(fields, clock, notes)
    requests = _smallest(
        [
            *_ietf(fields, clock, notes),
            _trio(fields, "x-ratelimit-", "", clock, notes),
            _trio(fields, "ratelimit-", "", clock, notes),
            _trio(fields, "x-ratelimit-", "-requests", clock, notes),
        ]
    )
    tokens = _trio(fields, "x-ratelimit-", "-tokens", clock, notes)
    if notes:
        logger.debug("ratelimit: upstream headers left out: %s", "; ".join(notes))
    return Observation(pause, requests, tokens)


def _retry_after(fields: dict[str, str], now: float, notes: list[str]) -> float | None:
    value = fields.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(int(value))
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - now
        except (TypeError, ValueError, IndexError):
            notes.append(f"Retry-After {value!r} is neither seconds nor an HTTP-date")
            return None
    if seconds > MAX_RESET:
        notes.append(f"Retry-After {value!r} is more than a day ahead: taken as a day")
    return min(max(seconds, 0.0), MAX_RESET)


def _count(name: str, value: str | None, notes: list[str]) -> int | None:
    """A non-negative integer header value (None: absent or unreadable)."""
    if value is None:
        return None
    text = value.split(",")[0].split(";")[0].strip()  # "100, 100;w=60": the first
    try:
        number = int(float(text))
    except (ValueError, OverflowError):
        notes.append(f"{name} {value!r} is not a number")
        return None
    if number < 0:
        notes.append(f"{name} {value!r} is negative")
        return None
    return number


def duration(text: str) -> float | None:
    """Seconds in a reset value: a number, or a Go duration (``6m0s``, ``1.5s``,
    ``20ms``); None if it is neither."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _early(value: str | None, seconds: float | None) -> float:
    """How much earlier than stated a reset ``value`` (read as ``seconds`` from now) may
    come: a second when it is stated in whole seconds, else 0."""
    if value is None or seconds is None:
        return 0.0
    text = value.split(",")[0].split(";")[0].strip()
    if not text or not _WHOLE.fullmatch(text) or (text.isdigit() and int(text) > EPOCH_MS_FLOOR):
        return 0.0  # a fraction, milliseconds (or epoch milliseconds)
    return min(1.0, seconds)


def _reset(name: str, value: str | None, now: float, notes: list[str]) -> float | None:
    """Seconds from ``now`` until a reset: delta seconds or a duration, epoch seconds
    (or milliseconds) when that large; None if unreadable or past, at most a day."""
    if value is None:
        return None
    seconds = duration(value.split(",")[0].split(";")[0])
    if seconds is None or not math.isfinite(seconds):
        notes.append(f"{name} {value!r} is not seconds, an instant or a duration")
        return None
    if seconds > EPOCH_MS_FLOOR:
        seconds = seconds / 1000 - now
    elif seconds > EPOCH_FLOOR:
        seconds -= now
    if seconds < 0:
        notes.append(f"{name} {value!r} is in the past")
        return None
    if seconds > MAX_RESET:
        notes.append(f"{name} {value!r} is more than a day ahead: taken as a day")
        seconds = MAX_RESET
    return seconds


def _trio(
    fields: dict[str, str], head: str, tail: str, now: float, notes: list[str]
) -> Budget | None:
    """The budget of ``{head}limit{tail}``, ``{head}remaining{tail}`` and
    ``{head}reset{tail}`` (a remaining and a reset are both needed)."""
    names = [f"{head}{part}{tail}" for part in ("limit", "remaining", "reset")]
    if names[1] not in fields and names[2] not in fields:
        return None
    remaining = _count(names[1], fields.get(names[1]), notes)
    reset = _reset(names[2], fields.get(names[2]), now, notes)
    if remaining is None or reset is None:
        if (names[1] in fields) != (names[2] in fields):
            notes.append(f"{names[1]} and {names[2]} come together")
        return None
    limit = _count(names[0], fields.get(names[0]), notes)
    window = _policy_window(fields.get(names[0], ""))
    return Budget(remaining, reset, limit, window, _early(fields[names[2]], reset))


def _policy_window(value: str) -> float | None:
    """The ``w`` of a draft-06 ``RateLimit-Limit: 100, 100;w=60``, if any."""
    for _, params in _members(value):
        if "w" in params:
            return duration(params["w"])
    return None


def _members(value: str) -> list[tuple[str, dict[str, str]]]:
    """A structured-field list (RFC 8941), loosely: each member's bare item (quotes
    removed) and its parameters."""
    members = []
    for raw in _split(value, ","):
        parts = _split(raw, ";")
        if not parts or not parts[0].strip():
            continue
        params = {}
        for param in parts[1:]:
            key, _, val = param.partition("=")
            params[key.strip().lower()] = val.strip().strip('"')
        members.append((parts[0].strip().strip('"'), params))
    return members


def _split(text: str, sep: str) -> list[str]:
    """``text`` split on ``sep`` outside double quotes."""
    parts: list[str] = []
    current: list[str] = []
    quoted = False
    for char in text:
        if char == '"':
            quoted = not quoted
        if char == sep and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _ietf(fields: dict[str, str], now: float, notes: list[str]) -> list[Budget | None]:
    """The budgets of the IETF ``RateLimit`` field, each matched with its policy in
    ``RateLimit-Policy`` (by name; in the draft-07 form, by its limit)."""
    value = fields.get("ratelimit")
    if value is None:
        return []
    members = _members(value)
    policies = {name: params for name, params in _members(fields.get("ratelimit-policy", ""))}
    if members and all("=" in name for name, _ in members):
        # draft-07: one dictionary, "limit=100, remaining=50, reset=30"
        said = dict(name.partition("=")[::2] for name, _ in members)
        limit = _count("RateLimit limit", said.get("limit"), notes)
        window = None
        if limit is not None and str(limit) in policies:
            window = duration(policies[str(limit)].get("w", ""))
        return [_ietf_budget(said.get("remaining"), said.get("reset"), limit, window, now, notes)]
    budgets = []
    for name, params in members:
        policy = policies.get(name, {})
        if policy.get("qu", "requests") != "requests":
            continue  # content-bytes, concurrent-requests: not a count of calls
        quota = policy.get("q", policy.get("l"))
        limit = _count(f"RateLimit-Policy {name}", quota, notes) if quota else None
        window = duration(policy["w"]) if "w" in policy else None
        budgets.append(_ietf_budget(params.get("r"), params.get("t"), limit, window, now, notes))
    return budgets


def _ietf_budget(
    remaining: str | None,
    reset: str | None,
    limit: int | None,
    window: float | None,
    now: float,
    notes: list[str],
) -> Budget | None:
    left = _count("RateLimit remaining", remaining, notes)
    # t may be left out: then the policy's window is the longest it can take
    seconds = window if reset is None else _reset("RateLimit reset", reset, now, notes)
    if left is None or seconds is None:
        if remaining is None:
            notes.append("RateLimit without a remaining")
        return None
    return Budget(left, seconds, limit, window, _early(reset, seconds))


def _smallest(budgets: list[Budget | None]) -> Budget | None:
    """The budget nearest to running out: the fewest units left, then the later reset."""
    found = [b for b in budgets if b is not None]
    if not found:
        return None
    return min(found, key=lambda b: (b.remaining, -b.reset))


def budget_for(limit: Any, seen: Observation) -> Budget | None:
    """Which budget of ``seen`` a limit takes: a limit counted in calls (its cost the
    default 1) the budget in requests; a limit that weighs its calls (another cost, or a
    cost function) the budget in tokens. A concurrency limit (its ``kind`` ``"conc"``)
    takes none."""
    if getattr(limit, "kind", None) == "conc":
        return None
    weighs = callable(limit.cost) or limit.cost != 1
    return seen.tokens if weighs else seen.requests


def budget_numbers(
    keys: Sequence[str], limits: Sequence[Any], seen: Observation
) -> tuple[list[str], list[int]]:
    """The log keys whose budget ``seen`` states, and (remaining, reset µs, quota) of
    each, for ``lua/observe.lua`` (see :func:`budget_for` for which a limit takes)."""
    noted: list[str] = []
    numbers: list[int] = []
    for name, limit in zip(keys, limits, strict=True):
        budget = budget_for(limit, seen)
        if budget is None:
            continue
        window = limit.fixed_rate.window_us
        quota = budget.limit or 0
        if budget.window is not None and abs(budget.window * 1_000_000 - window) > 1000:
            quota = 0  # a quota of another window says nothing of this limit's
        # a reset rounded up to whole seconds came up to a second earlier: where the
        # quota of this window is known, the budget holds until the earliest it may
        # have come, the quota pacing the calls in that second (the limit's own log
        # counts them); without one, until the reset stated
        reset = budget.reset - budget.early if quota else budget.reset
        noted.append(name)
        numbers += (budget.remaining, int(reset * 1_000_000), quota)
    return noted, numbers


__all__ = [
    "Budget",
    "Observation",
    "budget_for",
    "budget_numbers",
    "duration",
    "header_map",
    "parse",
]
