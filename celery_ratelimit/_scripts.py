"""The Lua scripts, read once from the package (or the source tree's ``lua/``), and the
numbers a call sends them."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from ._exceptions import InvalidLimit
from ._limit import Limit, check_cost

NAMES = ("sliding_log", "sliding_counter", "park")
#: Longest horizon accepted (seconds): a year, the longest window.
MAX_HORIZON = 366 * 86_400.0


@cache
def source(name: str) -> str:
    """The text of ``lua/<name>.lua``: packaged in the wheel, or beside the package in a
    source checkout."""
    if name not in NAMES:
        raise KeyError(name)
    packaged = resources.files("celery_ratelimit") / "lua" / f"{name}.lua"
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parent.parent / "lua" / f"{name}.lua").read_text(
        encoding="utf-8"
    )


def pack_numbers(
    limits: tuple[Limit, ...],
    cost: int | Sequence[int],
    mode: int,
    horizon: float,
    guard: float,
    hold: float,
) -> bytes:
    """The script's ARGV[2]: mode, horizon, guard and hold, then (limit, window,
    cost) of every limit, as packed doubles. ``cost``: one for every limit, or one
    per limit."""
    if isinstance(cost, int):
        costs: tuple[Any, ...] = (cost,) * len(limits)
    elif isinstance(cost, Sequence) and not isinstance(cost, (str, bytes)):
        costs = tuple(cost)
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
    numbers: list[int] = [
        mode,
        int(horizon * 1_000_000),
        int(guard * 1_000_000),
        int(hold * 1_000_000),
    ]
    for limit, one in zip(limits, costs, strict=True):
        check_cost(one)
        if one > limit.rate.limit:
            raise InvalidLimit(
                f"cost {one} is greater than the limit of {limit.label}: "
                "such a call could never run"
            )
        numbers += (limit.rate.limit, limit.rate.window_us, one)
    return struct.pack(f"<{len(numbers)}d", *numbers)
