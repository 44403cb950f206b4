"""A project's tests of its rate-limited tasks: pytest-celery's in-process worker, the
``ratelimit_*`` fixtures and ``limiter`` of celery-ratelimit's pytest plugin."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import tasks

from celery_ratelimit import Limit, Limiter


def most_in_window(stamps: Iterable[float], seconds: float) -> int:
    """The most stamps in any window of ``seconds`` (each window opening at a stamp)."""
    ordered = sorted(stamps)
    return max(
        (sum(1 for t in ordered[i:] if t < start + seconds) for i, start in enumerate(ordered)),
        default=0,
    )


def test_six_calls_start_at_most_two_a_second(
    celery_app: Any, celery_worker: Any, limiter: Limiter
) -> None:
    tasks.STARTS.clear()
    results = [tasks.fetch.delay(n) for n in range(6)]
    assert [r.get(timeout=60) for r in results] == list(range(6))  # nothing lost
    assert sorted(tasks.STARTS) == list(range(6))
    assert most_in_window(tasks.STARTS.values(), 1.0) <= 2


def test_a_spent_budget_defers_the_next_call(
    celery_app: Any, celery_worker: Any, limiter: Limiter
) -> None:
    spent_at = time.time()
    assert limiter.acquire("report", Limit("1/3s")).allowed  # the 3 s budget, spent here
    started, deferrals = tasks.report.delay().get(timeout=60)
    # Not before the budget comes back (the private server runs on this machine's
    # clock); deferred once on the way, unless the machine stalled the whole 3 s.
    assert started >= spent_at + 3.0, (started - spent_at, deferrals)
