"""What the tests and the benchmarks count in a run: the worst window, the most bodies
at once, Redis's clock in microseconds, and the shortest drain a limit allows.

One home for both: the benchmarks import it as ``tests.measure`` (they run from the
repository's root, ``python -m benchmarks...``), and so do the tests' worker apps.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any


def us(seconds: float) -> int:
    """A Decision time (float seconds) back in whole microseconds."""
    return round(seconds * 1_000_000)


def server_us(client: Any) -> int:
    """Redis ``TIME`` in microseconds."""
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def max_in_window(
    times: Iterable[float], window: float, weights: Iterable[int] | None = None
) -> int:
    """Largest total weight (each 1 unless ``weights``) of instants in any window
    ``(t - W, t]``: the window ends at an instant, ties included."""
    instants = list(times)
    ws = list(weights) if weights is not None else [1] * len(instants)
    ordered = sorted(zip(instants, ws, strict=True))
    ts = [t for t, _ in ordered]
    sums = [0]
    for _, w in ordered:
        sums.append(sums[-1] + w)
    best = 0
    for t in ts:
        hi = bisect.bisect_right(ts, t)
        lo = bisect.bisect_right(ts, t - window)
        best = max(best, sums[hi] - sums[lo])
    return best


def max_weight_in_window(events: Iterable[tuple[int, int]], window_us: int) -> int:
    """``max_in_window`` of ``(instant_us, weight)`` events, as a log's entries read."""
    pairs = list(events)
    return max_in_window([t for t, _ in pairs], window_us, [w for _, w in pairs])


def most_at_once(spans: Iterable[tuple[int, int]]) -> int:
    """The most ``(start, end)`` spans open at one instant (an end before a start at
    the same instant)."""
    spans = list(spans)
    events = sorted([(s, 1) for s, _ in spans] + [(e, 0) for _, e in spans])
    running = most = 0
    for _, starting in events:
        running += 1 if starting else -1
        most = max(most, running)
    return most


def percentiles(
    values: Sequence[float], points: Sequence[int] = (0, 50, 90, 99, 100)
) -> dict[int, float]:
    """Nearest-rank percentiles of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return {}
    return {p: ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in points}


def ideal_drain_us(tasks: int, limit: int, window_us: int, cost: int = 1) -> int:
    """Shortest possible time from the first grant to the last one for ``tasks`` calls
    of ``cost`` under ``limit`` per window: one full window between bursts."""
    per_window = limit // cost
    return (-(-tasks // per_window) - 1) * window_us
