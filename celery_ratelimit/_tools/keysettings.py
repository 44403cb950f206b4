"""What an operator or an upstream set on a logical key, read from its settings hash: a
pause, a rate override, what the upstream said, an adapting limit's effective rate.

``status`` finds the hashes by a scan of the prefix (:func:`key_settings`); the
operator's page reads those of the keys it shows (:func:`settings_for`). Both parse a
hash the same way (:func:`settings_row`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from .._engine.layout import (
    EFF_FIELD,
    PAUSE_FIELD,
    RATE_FIELD,
    SEEN_FIELD,
    effective,
    parse_override,
    parse_seen,
    prefix_glob,
    settings_key,
    settings_logical_key,
)
from .._engine.limiter import REDIS_ERRORS, Limiter
from .._engine.rate import Rate


@dataclass(frozen=True)
class Seen:
    """What an upstream said of one limit (its algorithm and window) of a key: units
    ``remaining`` for ``reset_in`` more seconds (0 and 0.0: its reset has passed), and the
    ``quota`` it stated, in force (0: none)."""

    algorithm: str
    window_us: int
    remaining: int
    reset_in: float
    quota: int


@dataclass(frozen=True)
class KeySettings:
    """What an operator set on a logical key: a pause (seconds left, 0 if none) and a
    rate override (``Limiter.override``) with the seconds it has left (None: no end)."""

    key: str
    paused_for: float = 0.0
    override: Rate | None = None
    override_for: float | None = None
    #: what the upstream said of each limit of the key (``Limiter.observe``)
    seen: tuple[Seen, ...] = ()
    #: (algorithm, window_us, effective limit) of each adapting limit cut since it was
    #: last back to its declared rate (``Limit(adapt=True)``)
    effective: tuple[tuple[str, int, int], ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The settings as ``status --json`` prints them: seconds, rates as text."""
        return {
            "key": self.key,
            "paused_for_s": self.paused_for,
            "override": str(self.override) if self.override else None,
            "override_for_s": self.override_for,
            "upstream": [
                {
                    "algorithm": seen.algorithm,
                    "window_s": seen.window_us / 1_000_000,
                    "remaining": seen.remaining,
                    "reset_in_s": seen.reset_in,
                    "quota": seen.quota,
                }
                for seen in self.seen
            ],
            "effective": [
                {"algorithm": algorithm, "window_s": window / 1_000_000, "limit": most}
                for algorithm, window, most in self.effective
            ],
        }


def settings_row(key: str, raw: dict[Any, Any], now: int) -> KeySettings | None:
    """The settings of ``key`` its hash's fields ``raw`` hold at ``now`` (µs); None
    when nothing in them is in force."""
    fields = {text(f): v for f, v in raw.items()}
    paused_for = max(float(fields.get(PAUSE_FIELD) or 0) - now, 0) / 1_000_000
    override = parse_override(fields.get(RATE_FIELD), now)
    seen = tuple(
        said
        for field, value in sorted(fields.items())
        if field.startswith(SEEN_FIELD) and (said := _seen(field, value, now))
    )
    rates = tuple(
        (algorithm, int(window), effective(value, int(window), now))
        for field, value in sorted(fields.items())
        if field.startswith(EFF_FIELD)
        for algorithm, _, window in [field[len(EFF_FIELD) :].partition(":")]
    )
    if not paused_for and override is None and not seen and not rates:
        return None
    if override is None:
        return KeySettings(key, paused_for, seen=seen, effective=rates)
    limit, window_us, ends = override
    left = (ends - now) / 1_000_000 if ends else None
    return KeySettings(key, paused_for, Rate(limit, window_us), left, seen, rates)


def key_settings(limiter: Limiter, match: str | None = None) -> list[KeySettings]:
    """The keys (matching the glob ``match``) that are paused or have a rate override."""
    from .ops import server_now_us

    client = limiter.client
    found = []
    try:
        now = server_now_us(client)
        for raw in client.scan_iter(f"{prefix_glob(limiter.prefix)[:-1]}*:settings"):
            name = text(raw)
            key = settings_logical_key(limiter.prefix, name)
            if key is None or (match is not None and not fnmatchcase(key, match)):
                continue  # not one of ours, or not asked for
            row = settings_row(key, client.hgetall(name), now)
            if row is not None:
                found.append(row)
    except REDIS_ERRORS as exc:
        raise limiter.translate(exc, "a status read") from exc
    return sorted(found, key=lambda row: row.key)


def settings_for(limiter: Limiter, keys: Iterable[str], now: int) -> dict[str, KeySettings]:
    """The settings in force of each of the (escaped) ``keys``, read by their names (one
    pipelined ``HGETALL`` each, no scan); keys with none are left out.

    Raises:
        redis errors, as they come (the caller translates them).
    """
    wanted = sorted(set(keys))
    pipe = limiter.client.pipeline(transaction=False)
    for key in wanted:
        pipe.hgetall(settings_key(limiter.prefix, key))
    found = {}
    for key, raw in zip(wanted, pipe.execute(), strict=True):
        row = settings_row(key, raw, now)
        if row is not None:
            found[key] = row
    return found


def _seen(field: str, value: bytes | str, now: int) -> Seen | None:
    """What the settings hash ``field`` of a limit holds at ``now`` (None: nothing)."""
    said = parse_seen(value, now)
    if said is None:
        return None
    algorithm, _, window = field[len(SEEN_FIELD) :].partition(":")
    remaining, reset, quota = said
    return Seen(algorithm, int(window), remaining, max(reset - now, 0) / 1_000_000, quota)


def text(key: bytes | str) -> str:
    """A Redis name or field as text."""
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key


__all__ = ["KeySettings", "Seen", "key_settings", "settings_for", "settings_row", "text"]
