"""The Celery app the worker-node tests start (``celery -A tests.apps.nodes worker``).

Configured from the environment by the test that starts the nodes:
CRL_BROKER, CRL_BACKEND, CRL_REDIS (limiter), CRL_PREFIX, CRL_RATE, CRL_RESERVE.
Every task records its execution (Redis TIME taken inside the task) in the list
``{CRL_PREFIX}:runs`` so the test can check the windows afterwards.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery, shared_task

from celery_ratelimit import Limit, RateLimitedTask, install, ratelimit

BROKER = os.environ.get("CRL_BROKER", "redis://127.0.0.1:6379/15")
REDIS = os.environ.get("CRL_REDIS", BROKER)
PREFIX = os.environ.get("CRL_PREFIX", "crl")
RATE = os.environ.get("CRL_RATE", "10/s")

app = Celery("nodes", broker=BROKER, backend=os.environ.get("CRL_BACKEND") or None)
app.conf.update(
    ratelimit_redis_url=REDIS,
    ratelimit_key_prefix=PREFIX,
    ratelimit_reserve=os.environ.get("CRL_RESERVE", "1") == "1",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("CRL_QUEUE", "celery"),
    ratelimit_rules={
        "tests.apps.nodes.via_rules": Limit(RATE, key="shared"),
        "tests.apps.nodes.shared_*": Limit(RATE, key="shared"),
    },
)
_client: redis.Redis | None = None


def record(task: Any, **extra: Any) -> int:
    """Append this execution to the runs list; returns Redis TIME in microseconds."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS)
    seconds, micros = _client.time()
    now = seconds * 1_000_000 + micros
    decision = getattr(task.request, "ratelimit_decision", None)
    _client.rpush(
        f"{PREFIX}:runs",
        json.dumps(
            {
                "id": task.request.id,
                "task": task.name,
                "t": now,
                "granted": int(decision.at * 1_000_000) if decision else None,
                "deferrals": getattr(task.request, "ratelimit_deferrals", 0) or 0,
                "retries": task.request.retries,
                "hostname": task.request.hostname,
                **extra,
            }
        ),
    )
    return now


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="shared"), bind=True)
def via_base(self: Any, i: int) -> int:
    record(self, i=i)
    return i


@ratelimit(RATE, key="shared")
@app.task(bind=True)
def via_decorator(self: Any, i: int) -> int:
    record(self, i=i)
    return i


@app.task(bind=True)
def via_rules(self: Any, i: int) -> int:
    record(self, i=i)
    return i


@ratelimit(RATE, key="shared")
@shared_task(bind=True)
def shared_decorated(self: Any, i: int) -> int:
    record(self, i=i)
    return i


@app.task(bind=True)
def unlimited(self: Any, i: int) -> int:
    record(self, i=i)
    return i


install(app)
