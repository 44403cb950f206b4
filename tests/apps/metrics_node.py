"""The app a metrics test starts as a real worker node (``celery -A
tests.apps.metrics_node worker``), serving its metrics by the recipe of
docs/operations.md, taken from the page and run as written.

Configured from the environment: CRL_BROKER, CRL_REDIS (limiter), CRL_PREFIX,
PROMETHEUS_MULTIPROC_DIR and METRICS_PORT (the recipe's). Every task appends its
argument to ``{CRL_PREFIX}:runs`` on the broker's Redis (up while the limiter's is not).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import redis
from celery import Celery

from celery_ratelimit import Limit, RateLimitedTask, UpstreamRateLimited

BROKER = os.environ.get("CRL_BROKER", "redis://127.0.0.1:6379/15")
REDIS = os.environ.get("CRL_REDIS", BROKER)
PREFIX = os.environ.get("CRL_PREFIX", "crl-metrics")
LABEL = "metrics-node-api"

app = Celery("metrics_node", broker=BROKER)
app.conf.update(
    ratelimit_redis_url=REDIS,
    ratelimit_key_prefix=PREFIX,
    ratelimit_metrics=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)


def recipe() -> str:
    """The metrics recipe of docs/operations.md, as a user copies it."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    block = re.search(r"<!-- metrics-recipe -->\n```python\n(.*?)```", page, re.DOTALL)
    assert block, "docs/operations.md has no metrics recipe"
    return block.group(1)


exec(compile(recipe(), "docs/operations.md", "exec"))


LIMIT = Limit("4/s", key="metrics-node", name=LABEL)


@app.task(base=RateLimitedTask, ratelimit=LIMIT)
def call(i: int) -> int:
    redis.Redis.from_url(BROKER).rpush(f"{PREFIX}:runs", i)
    return i


@app.task(base=RateLimitedTask, ratelimit=LIMIT)
def upstream(i: int) -> int:
    """Its first call meets the upstream's 429 (the keys pause), the next one runs."""
    broker = redis.Redis.from_url(BROKER)
    if broker.incr(f"{PREFIX}:429") == 1:
        raise UpstreamRateLimited(0.5)
    broker.rpush(f"{PREFIX}:runs", f"u{i}")
    return i


#: Paced: one start every 100 ms, so a second call's grant is a start 100 ms ahead,
#: which its greenlet sleeps out in-process (a slot under 200 ms is waited for there).
PACED = Limit("10/s", key="metrics-node-paced", burst=1, name="metrics-node-paced")


@app.task(base=RateLimitedTask, ratelimit=PACED)
def spin(i: int) -> int:
    """Yields 50 ms (the node takes the next task and its grant 100 ms ahead), then holds
    its process for 0.3 s without yielding (a CPU-bound body on a green pool): the next
    greenlet wakes from its wait that much late."""
    time.sleep(0.05)
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        pass
    redis.Redis.from_url(BROKER).rpush(f"{PREFIX}:runs", f"s{i}")
    return i
