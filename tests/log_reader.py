"""Read a sliding-log key as the tests see it, and wait for Redis's clock (what a
trace counts is in ``tests.measure``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis

from celery_ratelimit._engine import layout as _layout
from tests.measure import server_us

# the layout of a log, as the package reads it
ENTRY_FLOOR, TOKEN_LEN, weight_of = _layout.ENTRY_FLOOR, _layout.TOKEN_LEN, _layout.weight_of


def entries(client: redis.Redis, key: str) -> list[tuple[int, int]]:
    """``(instant_us, weight)`` of every entry in the log ``key``, oldest first."""
    return _layout.log_entries(client, key)


def total(client: redis.Redis, key: str) -> int:
    """The running total weight the script keeps for ``key`` (0 when absent)."""
    return _layout.log_total(client, key)


def weight_after(events: Sequence[tuple[int, int]], instant_us: int) -> int:
    """Weight of the events later than ``instant_us``."""
    return sum(w for t, w in events if t > instant_us)


def sleep_until(client: redis.Redis, instant_us: int) -> None:
    """Sleep until the Redis clock reads ``instant_us`` (approximately, from below)."""
    while (left := instant_us - server_us(client)) > 0:
        time.sleep(min(left / 1_000_000, 0.05))
