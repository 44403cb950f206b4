"""Read a sliding-log key as the tests see it, count the worst window of a trace, and
wait for Redis's clock."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Sequence

import redis

from celery_ratelimit._engine import layout as _layout

# the layout of a log, as the package reads it
ENTRY_FLOOR, TOKEN_LEN, weight_of = _layout.ENTRY_FLOOR, _layout.TOKEN_LEN, _layout.weight_of


def entries(client: redis.Redis, key: str) -> list[tuple[int, int]]:
    """``(instant_us, weight)`` of every entry in the log ``key``, oldest first."""
    return _layout.log_entries(client, key)


def total(client: redis.Redis, key: str) -> int:
    """The running total weight the script keeps for ``key`` (0 when absent)."""
    return _layout.log_total(client, key)


def us(seconds: float) -> int:
    """A Decision time (float seconds) back in whole microseconds."""
    return round(seconds * 1_000_000)


def max_in_window(events: Iterable[tuple[int, int]], window_us: int) -> int:
    """Largest total weight of ``(instant_us, weight)`` events in any window (t - W, t]."""
    ordered = sorted(events)
    times = [t for t, _ in ordered]
    sums = [0]
    for _, w in ordered:
        sums.append(sums[-1] + w)
    best = 0
    for t in times:
        hi = bisect.bisect_right(times, t)  # the window ends at t, ties included
        lo = bisect.bisect_right(times, t - window_us)
        best = max(best, sums[hi] - sums[lo])
    return best


def weight_after(events: Sequence[tuple[int, int]], instant_us: int) -> int:
    """Weight of the events later than ``instant_us``."""
    return sum(w for t, w in events if t > instant_us)


def server_us(client: redis.Redis) -> int:
    """Redis ``TIME`` in microseconds."""
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def sleep_until(client: redis.Redis, instant_us: int) -> None:
    """Sleep until the Redis clock reads ``instant_us`` (approximately, from below)."""
    while (left := instant_us - server_us(client)) > 0:
        time.sleep(min(left / 1_000_000, 0.05))
