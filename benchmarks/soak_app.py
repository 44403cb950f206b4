"""The Celery app the soak's worker nodes run (``celery -A benchmarks.soak_app worker``).

Configured from the environment by ``benchmarks.soak``: ``SOAK_BROKER``,
``SOAK_REDIS`` (the limiter; unset: the broker's own Redis, the default configuration),
``SOAK_PREFIX``, ``SOAK_RECORD`` (a file every execution appends a line to: the record
kept outside the servers the soak breaks), ``SOAK_UPSTREAM`` (the fake upstream's URL).

Every task is ``acks_late`` with ``task_reject_on_worker_lost`` (a killed node's tasks
are delivered again), under the default ``ratelimit_on_redis_error = "defer"`` (fail
closed: no window may start more than its limit, ever). :data:`LIMITS` is what the
soak checks each task's grants against: the same limits as the tasks declare.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from celery import Celery

from celery_ratelimit import Concurrency, Limit, RateLimitedTask, UpstreamRateLimited

BROKER = os.environ.get("SOAK_BROKER", "redis://127.0.0.1:6379/15")
PREFIX = os.environ.get("SOAK_PREFIX", "soak")
RECORD = os.environ.get("SOAK_RECORD", "soak-runs.jsonl")
UPSTREAM = os.environ.get("SOAK_UPSTREAM", "")
#: Seconds the ``slotted`` body holds its concurrency slot.
SLOTTED_BODY = 0.8
#: The concurrency lease: a killed node's slot comes back after this long.
LEASE = 10.0

#: task name -> (limit key, units per window, window in seconds) its grants must fit;
#: a call's units are its ``cost`` (1 unless the record says otherwise).
LIMITS: dict[str, list[tuple[str, int, float]]] = {
    "stacked": [("stacked", 3, 1.0), ("stacked", 10, 5.0)],
    "weighted": [("weighted", 4, 1.0)],
    "slotted": [("slotted", 2, 1.0)],
    "fair": [("fair", 3, 1.0)],
    "upstream": [("upstream", 2, 1.0)],
}
#: task name -> bodies at once at most (``Concurrency``).
AT_ONCE = {"slotted": 2}

app = Celery("soak", broker=BROKER)
app.conf.update(
    ratelimit_key_prefix=PREFIX,
    ratelimit_on_redis_error="defer",
    ratelimit_redis_error_countdown=1.0,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    worker_prefetch_multiplier=1,
    worker_cancel_long_running_tasks_on_connection_loss=False,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_ignore_result=True,
    # a killed node's unacknowledged messages come back within about 30 s
    broker_transport_options={
        "visibility_timeout": 30,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 5,
    },
)
if os.environ.get("SOAK_REDIS"):
    app.conf.ratelimit_redis_url = os.environ["SOAK_REDIS"]
if BROKER.startswith("amqp"):
    # publisher confirms (README, "Failure modes"): a deferred copy RabbitMQ does not
    # confirm fails its publish, and its original is requeued
    app.conf.broker_transport_options = {"confirm_publish": True}
if os.environ.get("SOAK_REDIS") and BROKER.startswith("redis"):
    # The park is off (it is on only on the broker's Redis): a deferred copy waits in
    # the Redis broker as an ETA message, which must not outlive the visibility timeout
    # above. With the park on, a copy due later than ratelimit_park_after waits in the
    # park; a RabbitMQ broker has no visibility timeout (a consumer holds an ETA message
    # unacknowledged for as long as it waits): both keep the default horizon (600 s).
    app.conf.ratelimit_max_countdown = 10.0


def record(task: Any, event: str, **extra: Any) -> None:
    """Append one line to the record: ``s`` a body started (with its grant's instant, by
    the limiter's Redis clock, as the decision carries it), ``d`` it finished."""
    decision = getattr(task.request, "ratelimit_decision", None)
    line = {
        "e": event,
        "id": task.request.id,
        "task": task.name.rsplit(".", 1)[-1],
        "at": round(decision.at * 1_000_000) if decision is not None else None,
        "reserved": getattr(decision, "reserved", None),
        "token": getattr(decision, "token", None),
        "deferrals": getattr(task.request, "ratelimit_deferrals", 0) or 0,
        "t": time.time(),
        "pid": os.getpid(),
        "node": task.request.hostname,
        **extra,
    }
    data = (json.dumps(line) + "\n").encode()
    fd = os.open(RECORD, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)  # one write of one line: whole, whatever else appends
    finally:
        os.close(fd)


def units(units: int, i: int) -> int:
    return units


@app.task(
    base=RateLimitedTask,
    ratelimit=[Limit("3/s", key="stacked"), Limit("10/5s", key="stacked")],
    bind=True,
)
def stacked(self: Any, i: int) -> int:
    """Two limits stacked on one key, checked all or nothing."""
    record(self, "s")
    record(self, "d")
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit("4/s", key="weighted", cost=units), bind=True)
def weighted(self: Any, units: int, i: int) -> int:
    """A cost of 1 to 3 units a call."""
    record(self, "s", cost=units)
    record(self, "d")
    return i


@app.task(
    base=RateLimitedTask,
    ratelimit=[Concurrency(2, key="slotted", lease=LEASE), Limit("2/s", key="slotted")],
    bind=True,
)
def slotted(self: Any, i: int) -> int:
    """At most two bodies at once (each holds its slot ``SLOTTED_BODY`` s), 2 a second."""
    run = uuid.uuid4().hex  # pairs this body's start with its end
    record(self, "s", run=run)
    time.sleep(SLOTTED_BODY)
    record(self, "d", run=run)
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit("3/s", key="fair", fair_key="{tenant}"), bind=True)
def fair(self: Any, tenant: str, i: int) -> int:
    """One budget shared fairly by tenants that send unevenly."""
    record(self, "s", tenant=tenant)
    record(self, "d")
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit("2/s", key="upstream"), bind=True)
def upstream(self: Any, i: int) -> int:
    """Calls a fake upstream that allows as much as the limit, by its own clock: when
    the two disagree its 429 pauses the key on every node, and the task runs again
    after the pause."""
    record(self, "s")
    try:
        with urllib.request.urlopen(f"{UPSTREAM}?task={self.request.id}", timeout=5):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code == 429:
            raise UpstreamRateLimited(exc.headers.get("Retry-After")) from exc
        raise
    record(self, "d")
    return i
