"""The existing project's Celery app, with worker-wide rate limits added in config only.

``install(app)`` applies ``app.conf.ratelimit_rules`` to every task whose name matches,
whichever way it was declared (``@app.task``, ``@shared_task``), without touching
``tasks.py``. An exact task name wins over a glob; tasks no rule matches (and
Celery's own ``celery.*`` tasks) are never limited.

Run it (a Redis on localhost, or the URLs below)::

    celery -A examples.existing_project worker -c 2 &
    python -m examples.existing_project

Environment: ``CELERY_BROKER_URL`` (default ``redis://localhost:6379/1``),
``RATELIMIT_REDIS_URL`` (default ``redis://localhost:6379/0``).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery, signals

from celery_ratelimit import Limit, install

BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/1")
REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://localhost:6379/0")
RUNS = "example:project:runs"

app = Celery("existing_project", broker=BROKER_URL, include=["examples.existing_project.tasks"])
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    ratelimit_redis_url=REDIS_URL,
    ratelimit_key_prefix="example",
    ratelimit_rules={
        # Both billing tasks spend from one budget: the key is explicit and shared.
        "examples.existing_project.tasks.sync_*": Limit("4/s", key="billing:api"),
        # The default key is the task name: this task alone.
        "examples.existing_project.tasks.send_email": "2/s",
    },
)
install(app)


_client: redis.Redis | None = None


@signals.task_postrun.connect
def _record(task: Any = None, state: str | None = None, **_: Any) -> None:
    """Record each limited execution's task name and grant time, for the example's
    report (bookkeeping of the example, not needed for the limits)."""
    global _client
    decision = getattr(task.request, "ratelimit_decision", None)
    if state != "SUCCESS" or decision is None:
        return
    if _client is None:
        _client = redis.Redis.from_url(REDIS_URL)
    _client.rpush(RUNS, f"{task.name} {int(decision.at * 1_000_000)}")
