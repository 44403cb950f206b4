"""The Lua scripts, read once from the package (or the source tree's ``lua/``), and the
numbers a call sends them.

A script may include another file of ``lua/`` with a line ``--- @include "file.lua"``
(as BullMQ's scripts do): the file's text takes that line's place, so that Redis runs
one script while a reader has files of a readable size."""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from ._calendar import boundaries, zone_of
from ._exceptions import InvalidLimit
from ._limit import DEFAULT_LEASE, Concurrency, check_cost
from ._rate import Rate

NAMES = ("sliding_log", "sliding_counter", "concurrency", "park")
_INCLUDE = re.compile(r'^--- @include "([a-z_]+\.lua)"$', re.MULTILINE)
#: Longest horizon accepted (seconds): a year, the longest window.
MAX_HORIZON = 366 * 86_400.0
#: The mode of a settle (see lua/sliding_log.lua): its costs may be 0 or above a limit.
SETTLE = 9
#: Reservations are never made further ahead than this by default (seconds).
DEFAULT_HORIZON = 3600.0


@cache
def source(name: str) -> str:
    """The script ``lua/<name>.lua``, its ``@include`` lines replaced by those files."""
    if name not in NAMES:
        raise KeyError(name)
    return _INCLUDE.sub(lambda m: _read(m.group(1)).rstrip("\n"), _read(f"{name}.lua"))


def _read(filename: str) -> str:
    """A file of ``lua/``: packaged in the wheel, or beside the package in a checkout."""
    packaged = resources.files("celery_ratelimit") / "lua" / filename
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parent.parent / "lua" / filename).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Shape:
    """What a script call sends besides its keys and token: the limits (rate limits,
    then concurrency limits), the cost (one for every limit, or one per limit), the
    mode, the options of the Celery layer (``horizon``, ``guard`` and ``hold``, in
    seconds) and the lease of a concurrency limit that gives
    none (seconds; None: ``DEFAULT_LEASE``).

    ``cost`` is one cost for every limit, or one per limit (a units quota and a
    per-call cap checked together). ``guard`` (seconds; at most 4% of each window is
    used) widens the windows in which calls are *placed*, while a confirmed reservation
    starts as soon as its cost fits a window only half of it wider: a task that starts
    up to half of ``guard`` after its slot costs no extra wait, and bodies that begin
    up to half of it after their recorded start still never put more than the limit in
    a window (the Celery layer's ``ratelimit_guard``). ``hold`` (seconds, ``"log"``
    only): a reservation or confirmation whose start is at most this far ahead is
    counted as started at that instant and answered ``allowed`` with ``retry_after`` >
    0: the caller waits that long, then runs, with no second call (the Celery layer
    waits in-process up to 0.2 s).

    Hashable, so a limiter remembers what it sends for a shape; its packed numbers are
    worked out, and checked, once.
    """

    limits: tuple[Any, ...]
    cost: int | tuple[int, ...] = 1
    mode: int = 0
    horizon: float = DEFAULT_HORIZON
    guard: float = 0.0
    hold: float = 0.0
    lease: float | None = None

    def with_mode(self, mode: int) -> Shape:
        return self if mode == self.mode else replace(self, mode=mode)

    @property
    def cacheable(self) -> bool:
        """Only exact ints may be remembered: a bool or a float hashes like an int."""
        costs = self.cost if type(self.cost) is tuple else (self.cost,)
        return all(type(one) is int for one in costs)

    @cached_property
    def aligned(self) -> tuple[tuple[int, ZoneInfo], ...]:
        """(window µs, zone) of every calendar-aligned limit, in order."""
        return tuple(
            (limit.fixed_rate.window_us, zone_of(limit.align))
            for limit in self.limits
            if not isinstance(limit, Concurrency) and limit.align is not None
        )

    def calendar(self) -> bytes:
        """The aligned limits' window boundaries around this machine's clock now (sent
        after :attr:`numbers`; empty when there are none)."""
        return b"".join(boundaries(window, zone) for window, zone in self.aligned)

    @cached_property
    def numbers(self) -> bytes:
        """The script's ARGV[2] but for calendar boundaries (see :meth:`aligned`): mode,
        horizon, guard, hold, how many concurrency limits, settings keys (one per limit)
        and aligned limits, then (limit, window, cost) of every rate limit (sliding, then
        aligned) and (n, lease) of every concurrency limit, as packed doubles.

        Raises:
            InvalidLimit, TypeError: a bad cost or horizon, naming it.
        """
        limits, cost, horizon = self.limits, self.cost, self.horizon
        if isinstance(cost, int):
            costs: tuple[Any, ...] = (cost,) * len(limits)
        elif isinstance(cost, tuple):
            costs = cost
        else:
            raise TypeError(f"cost must be a positive int or one int per limit, got {cost!r}")
        if len(costs) != len(limits):
            raise InvalidLimit(f"got {len(costs)} costs for {len(limits)} limits")
        if isinstance(horizon, bool) or not isinstance(horizon, (int, float)):
            raise TypeError(f"horizon must be a number of seconds, got {horizon!r}")
        if not 0 < horizon <= MAX_HORIZON:
            raise InvalidLimit(
                f"horizon must be more than 0 and at most {MAX_HORIZON:g} seconds, got {horizon!r}"
            )
        slots = [limit for limit in limits if isinstance(limit, Concurrency)]
        numbers: list[int] = [
            self.mode,
            int(horizon * 1_000_000),
            int(self.guard * 1_000_000),
            int(self.hold * 1_000_000),
            len(slots),
            len(limits),
            len(self.aligned),
        ]
        for limit, one in zip(limits, costs, strict=True):
            if isinstance(limit, Concurrency):
                continue
            if self.mode == SETTLE:
                # a real cost known after the call: a refund to 0, or above the limit
                if isinstance(one, bool) or not isinstance(one, int) or one < 0:
                    raise InvalidLimit(f"a settled cost must be an int of 0 or more, got {one!r}")
                numbers += (limit.fixed_rate.limit, limit.fixed_rate.window_us, one)
                continue
            check_cost(one)
            if one > limit.fixed_rate.limit:
                raise InvalidLimit(
                    f"cost {one} is greater than the limit of {limit.label}: "
                    "such a call could never run"
                )
            numbers += (limit.fixed_rate.limit, limit.fixed_rate.window_us, one)
        for slot in slots:
            lease = slot.lease or self.lease or DEFAULT_LEASE
            numbers += (slot.n, int(lease * 1_000_000))
        return struct.pack(f"<{len(numbers)}d", *numbers)


def pause_numbers(seconds: float, keys: int) -> bytes:
    """ARGV[2] of a pause (mode 7) of ``keys`` settings hashes for ``seconds``."""
    return struct.pack("<7d", 7, int(seconds * 1_000_000), 0, 0, 0, keys, 0)


def override_numbers(rate: Rate | None, ttl: float | None) -> bytes:
    """ARGV[2] of a rate override (mode 8) of one settings hash: ``rate`` (None:
    remove) for ``ttl`` seconds (None: until removed).

    Raises:
        InvalidLimit, TypeError: a bad ``ttl``, naming it.
    """
    ttl_us = 0
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            raise TypeError(f"ttl must be a number of seconds or None, got {ttl!r}")
        if not 0 < ttl <= MAX_HORIZON:
            raise InvalidLimit(
                f"ttl must be more than 0 and at most {MAX_HORIZON:g} seconds, got {ttl!r}"
            )
        ttl_us = max(int(ttl * 1_000_000), 1)
    limit, window_us = (rate.limit, rate.window_us) if rate is not None else (0, 0)
    return struct.pack("<7d", 8, ttl_us, limit, window_us, 0, 1, 0)


def shape(
    limits: tuple[Any, ...],
    cost: int | Sequence[int],
    mode: int,
    horizon: float = DEFAULT_HORIZON,
    guard: float = 0.0,
    hold: float = 0.0,
    lease: float | None = None,
) -> Shape:
    """A :class:`Shape`, a sequence of costs made a tuple (so that it hashes)."""
    if isinstance(cost, Sequence) and not isinstance(cost, (str, bytes)):
        cost = tuple(cost)
    return Shape(limits, cost, mode, horizon, guard, hold, lease)  # type: ignore[arg-type]
