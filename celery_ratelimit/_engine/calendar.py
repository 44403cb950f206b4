"""Calendar windows: where the fixed windows of ``Limit(..., align=zone)`` begin.

Lua in Redis has no time zones, so the caller works the boundaries out (``zoneinfo``)
and sends them with the call; the script picks the window that holds Redis's own clock.
A day runs from midnight to midnight on the zone's wall clock (23 or 25 hours on a DST
day; from the transition when a zone skips midnight); an hour and a minute are the
zone's: every 3,600 and 60 seconds of real time, in step with its UTC offset.
"""

from __future__ import annotations

import time
from datetime import date, datetime, timedelta, timezone
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .exceptions import InvalidLimit

MINUTE, HOUR, DAY = 60_000_000, 3_600_000_000, 86_400_000_000
#: The windows an aligned limit may have (µs), by the unit of its rate.
ALIGNED_WINDOWS = {MINUTE: "minute", HOUR: "hour", DAY: "day"}
#: Boundaries sent per aligned limit: the window before the caller's, the caller's and
#: three more (beyond them the script steps by the nominal window).
BOUNDARIES = 6


def zone_of(name: object) -> ZoneInfo:
    """The IANA zone ``name`` (``"UTC"``, ``"America/Los_Angeles"``).

    Raises:
        InvalidLimit: not a zone name this machine's tz database knows.
    """
    if not isinstance(name, str) or not name:
        raise InvalidLimit(f"align must be an IANA time zone name such as 'UTC', got {name!r}")
    try:
        return _zone(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidLimit(
            f"unknown time zone align={name!r}: expected an IANA name such as "
            "'UTC' or 'America/Los_Angeles' (on Windows, pip install tzdata)"
        ) from None


@lru_cache(maxsize=64)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


def check_window(window_us: int, rate: object) -> None:
    """Raise unless an aligned limit's window is one minute, hour or day."""
    if window_us not in ALIGNED_WINDOWS:
        raise InvalidLimit(
            f"an aligned limit's rate must be per minute, hour or day "
            f"('100/m', '5000/h', '10000/d'), got {rate}"
        )


def _us(moment: datetime) -> int:
    return round(moment.timestamp()) * 1_000_000


def _midnight(day: date, zone: ZoneInfo) -> int:
    # fold 0: a midnight the zone skips maps to the instant of its transition
    return _us(datetime(day.year, day.month, day.day, tzinfo=zone))


def window_start(at_us: int, window_us: int, zone: ZoneInfo) -> int:
    """The start (µs since the epoch) of the aligned window holding ``at_us``."""
    moment = datetime.fromtimestamp(at_us / 1_000_000, timezone.utc).astimezone(zone)
    if window_us == DAY:
        start = _midnight(moment.date(), zone)
        if start > at_us:  # the day began with a skipped midnight's transition
            start = _midnight(moment.date() - timedelta(days=1), zone)
        return start
    offset = moment.utcoffset()
    offset_us = int(offset.total_seconds()) * 1_000_000 if offset else 0
    return (at_us + offset_us) // window_us * window_us - offset_us


def next_start(start_us: int, window_us: int, zone: ZoneInfo) -> int:
    """The start of the aligned window after the one starting at ``start_us``."""
    if window_us == DAY:
        moment = datetime.fromtimestamp(start_us / 1_000_000, timezone.utc).astimezone(zone)
        return _midnight(moment.date() + timedelta(days=1), zone)
    # the window holding a moment past this one's nominal end (an offset change
    # shortens or lengthens at most one window)
    following = window_start(start_us + window_us, window_us, zone)
    return following if following > start_us else start_us + window_us


def _boundaries(start_us: int, window_us: int, zone: ZoneInfo) -> tuple[int, ...]:
    first = window_start(start_us - 1, window_us, zone)
    every = [first, start_us]
    while len(every) < BOUNDARIES:
        every.append(next_start(every[-1], window_us, zone))
    return tuple(every)


#: (window µs, zone) -> (start, end, boundaries) of the window last asked for.
_CURRENT: dict[tuple[int, ZoneInfo], tuple[int, int, tuple[int, ...]]] = {}


def boundaries(window_us: int, zone: ZoneInfo, now_us: int | None = None) -> tuple[int, ...]:
    """The boundaries (µs) sent for an aligned limit: the start of the window before
    the one holding ``now_us`` (default: this machine's clock), of that one, and of the
    four after it. Worked out once per window (a decision asks about 1 us)."""
    if now_us is None:
        now_us = time.time_ns() // 1000
    current = _CURRENT.get((window_us, zone))
    if current is not None and current[0] <= now_us < current[1]:
        return current[2]
    start = window_start(now_us, window_us, zone)
    packed = _boundaries(start, window_us, zone)
    _CURRENT[(window_us, zone)] = (start, next_start(start, window_us, zone), packed)
    return packed


__all__ = [
    "ALIGNED_WINDOWS",
    "BOUNDARIES",
    "boundaries",
    "check_window",
    "next_start",
    "window_start",
    "zone_of",
]
