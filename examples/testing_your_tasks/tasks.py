"""The code under test: two rate-limited tasks, as they would sit in a project."""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

from celery_ratelimit import Limit, RateLimitedTask

#: When each call's body started (``time.time()``, its first line), by call number.
STARTS: dict[int, float] = {}


@shared_task(base=RateLimitedTask, ratelimit=Limit("2/s", key="fetch"))
def fetch(n: int) -> int:
    STARTS[n] = time.time()
    return n


@shared_task(bind=True, base=RateLimitedTask, ratelimit=Limit("1/3s", key="report"))
def report(self: Any) -> tuple[float, int]:
    """When the body started, and how many times the call was deferred before (0 when
    it ran at its first try)."""
    return time.time(), int(self.request.ratelimit_deferrals)
