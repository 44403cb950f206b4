"""The Celery app the demo's worker nodes run (``celery -A celery_ratelimit._tools.demo_app``).

Configured from the environment by ``celery-ratelimit demo``: CRL_DEMO_BROKER,
CRL_DEMO_REDIS (the limiter's Redis), CRL_DEMO_RATE, CRL_DEMO_RESERVE, CRL_DEMO_BURST
(empty: not paced). Each execution
appends the instant it started, its grant and its deferrals to ``demo:runs``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from .._celery.task import RateLimitedTask
from .._engine.limit import Limit

REDIS = os.environ.get("CRL_DEMO_REDIS", "redis://127.0.0.1:6379/0")
BROKER = os.environ.get("CRL_DEMO_BROKER", REDIS)
RATE = os.environ.get("CRL_DEMO_RATE", "10/s")
BURST = int(os.environ.get("CRL_DEMO_BURST") or 0) or None
RUNS = "demo:runs"

app = Celery("celery_ratelimit_demo", broker=BROKER)
app.conf.update(
    ratelimit_redis_url=REDIS,
    ratelimit_key_prefix="demo",
    ratelimit_reserve=os.environ.get("CRL_DEMO_RESERVE", "1") == "1",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
_client: redis.Redis | None = None


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="metered-api", burst=BURST), bind=True)  # type: ignore[untyped-decorator]
def call_api(self: Any, i: int) -> int:
    """Stands for one call to a metered API: records when it started (this machine's
    clock, read first thing: the demo's redis-server runs here, so it is Redis's clock
    too), the instant the limiter granted it and how often it was deferred."""
    started = time.time_ns() // 1000
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS)
    decision = getattr(self.request, "ratelimit_decision", None)
    granted = int(decision.at * 1_000_000) if decision else started
    deferrals = getattr(self.request, "ratelimit_deferrals", 0) or 0
    _client.rpush(RUNS, f"{started} {granted} {deferrals}")
    return i
