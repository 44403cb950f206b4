"""The Celery app the fault tests start (``celery -A tests.apps.faults worker``).

Configured from the environment by the test that starts the nodes:

- ``CRL_BROKER``: the broker; ``CRL_REDIS``: the limiter's Redis URL (may be a
  ``redis+sentinel://`` URL, may be down); ``CRL_RUNS``: a plain Redis URL where every
  execution is recorded (never the limiter's, which the tests break);
- ``CRL_PREFIX``, ``CRL_RATE``; ``CRL_POLICY`` (``ratelimit_on_redis_error``),
  ``CRL_WARN_INTERVAL``, ``CRL_ERROR_COUNTDOWN``, ``CRL_MAX_COUNTDOWN``,
  ``CRL_MAX_DEFERRALS``, ``CRL_CONCURRENCY_LEASE``;
- ``CRL_MASTER_NAME``: the Sentinel service of a ``sentinel://`` broker;
- ``CRL_SLEEP``: seconds each body sleeps; ``CRL_VISIBILITY``: the Redis transport's
  ``visibility_timeout``; ``CRL_QUEUE``: the default queue (one per test on RabbitMQ);
  ``CRL_CONFIRM``: RabbitMQ publisher confirms (``confirm_publish``);
  ``CRL_BROKER_WRITE``: the nodes' ``broker_write_url``; ``CRL_CONSUME``: the queues
  they consume (``task_queues``), when not the default queue.

Tasks are ``acks_late`` with ``reject_on_worker_lost``: a killed worker's task is
delivered again.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from kombu import Queue

from celery_ratelimit import (
    Concurrency,
    Limit,
    RateLimitedTask,
    UpstreamRateLimited,
    install,
    ratelimit,
)
from tests.measure import server_us

BROKER = os.environ.get("CRL_BROKER", "redis://127.0.0.1:6379/15")
REDIS = os.environ.get("CRL_REDIS", BROKER)
RUNS = os.environ.get("CRL_RUNS", BROKER)
PREFIX = os.environ.get("CRL_PREFIX", "crl")
RATE = os.environ.get("CRL_RATE", "10/s")
SLEEP = float(os.environ.get("CRL_SLEEP", "0"))

app = Celery("faults", broker=BROKER)
app.conf.update(
    ratelimit_redis_url=REDIS,
    ratelimit_key_prefix=PREFIX,
    ratelimit_on_redis_error=os.environ.get("CRL_POLICY", "defer"),
    ratelimit_warning_interval=float(os.environ.get("CRL_WARN_INTERVAL", "60")),
    ratelimit_redis_error_countdown=float(os.environ.get("CRL_ERROR_COUNTDOWN", "1")),
    ratelimit_max_countdown=float(os.environ.get("CRL_MAX_COUNTDOWN", "600")),
    ratelimit_concurrency_lease=float(os.environ.get("CRL_CONCURRENCY_LEASE", "300")),
    ratelimit_max_deferrals=(
        int(os.environ["CRL_MAX_DEFERRALS"]) if os.environ.get("CRL_MAX_DEFERRALS") else None
    ),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_default_queue=os.environ.get("CRL_QUEUE", "celery"),
    # the third form of the key shapes the README teaches (``door_*``)
    ratelimit_rules={"tests.apps.faults.door_erp": Limit(RATE, key="{k}:erp")},
)
if os.environ.get("CRL_CONSUME"):
    # the queues the nodes consume, the default queue (where a task goes unrouted) not
    # among them
    app.conf.task_queues = [Queue(name) for name in os.environ["CRL_CONSUME"].split(",")]
if os.environ.get("CRL_BROKER_WRITE"):
    # publishes (a deferred copy's) on a connection of their own (Celery's
    # broker_write_url), which a test can refuse while the consumer's still acks
    app.conf.broker_write_url = os.environ["CRL_BROKER_WRITE"]
_transport: dict[str, Any] = {}
if os.environ.get("CRL_MASTER_NAME"):
    # a broker on a Sentinel group (sentinel://h:p;sentinel://h:p): kombu's service name
    _transport["master_name"] = os.environ["CRL_MASTER_NAME"]
if os.environ.get("CRL_VISIBILITY"):
    # a low visibility timeout, swept every second, redelivers a killed node's messages
    # soon; the sweep's lock expires soon too (a node killed holding it would otherwise
    # stop every sweep for the default 5 minutes)
    _transport.update(
        visibility_timeout=float(os.environ["CRL_VISIBILITY"]),
        unacked_restore_interval=1,
        unacked_restore_throttle=1,
        unacked_mutex_expire=5,
    )
if os.environ.get("CRL_CONFIRM"):
    # RabbitMQ publisher confirms (README, "Failure modes"): a deferred copy's publish
    # returns once the broker has taken it, and raises if it refused it
    _transport["confirm_publish"] = True
if _transport:
    app.conf.broker_transport_options = _transport
_client: redis.Redis | None = None


def record(task: Any, **extra: Any) -> None:
    """Append this execution to ``{prefix}:runs`` on the runs Redis (never the limiter's)."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(RUNS)
    decision = getattr(task.request, "ratelimit_decision", None)
    _client.rpush(
        f"{PREFIX}:runs",
        json.dumps(
            {
                "id": task.request.id,
                "t": server_us(_client),
                "local": time.time(),
                "granted": round(decision.at * 1_000_000) if decision is not None else None,
                "deferrals": getattr(task.request, "ratelimit_deferrals", 0) or 0,
                "hostname": task.request.hostname,
                "pid": os.getpid(),
                "policy": getattr(task.request, "ratelimit_on_redis_error", None),
                "queue": (task.request.delivery_info or {}).get("routing_key"),
                **extra,
            }
        ),
    )


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="api:{tenant}"), bind=True)
def per_tenant(self: Any, tenant: str, i: int) -> int:
    """The README's per-tenant key: one budget, and one Cluster slot, per tenant."""
    record(self, i=i, tenant=tenant)
    return i


# The key shapes the README teaches, one per form (base class, decorator, rules): an
# override, a pause or a producer's acquire on the rendered key must reach them.
@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="api:{k}"), bind=True)
def door_api(self: Any, k: str, i: int) -> int:
    record(self, i=i, k=k)
    return i


@ratelimit(RATE, key="yt:quota:{k}")
@app.task(bind=True)
def door_quota(self: Any, k: str, i: int) -> int:
    record(self, i=i, k=k)
    return i


@app.task(bind=True)
def door_erp(self: Any, k: str, i: int) -> int:
    record(self, i=i, k=k)
    return i


# A concurrency slot's lease, by where it comes from: the app's setting, the task's own
# option, the task's time_limit (which wins over the option).
def _leased(name: str, key: str, **options: Any) -> Any:
    """A task holding a slot of Concurrency(1, key=key) for 3 s, with ``options``."""

    @app.task(
        base=RateLimitedTask,
        ratelimit=Concurrency(1, key=key),
        bind=True,
        name=f"{__name__}.{name}",
        **options,
    )
    def leased(self: Any, i: int) -> int:
        record(self, i=i)
        time.sleep(3)
        return i

    return leased


leased = _leased("leased", "leased")
leased_own = _leased("leased_own", "leased:own", ratelimit_concurrency_lease=11)
leased_timed = _leased(
    "leased_timed", "leased:timed", ratelimit_concurrency_lease=11, time_limit=20
)


@app.task(base=RateLimitedTask, ratelimit=Limit("100/m", key="pauser"), bind=True)
def upstream_429(self: Any, key: str) -> None:
    """A body whose upstream answered 429 for ``key``, another task's rendered key (the
    fourth door: ``UpstreamRateLimited(key=...)``)."""
    record(self, key=key)
    raise UpstreamRateLimited(120, key=key)


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="shared"), bind=True)
def limited(self: Any, i: int) -> int:
    record(self, i=i)
    if SLEEP:
        time.sleep(SLEEP)
        record(self, i=i, done=True)
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="shared"), bind=True, acks_late=False)
def limited_acks_early(self: Any, i: int) -> int:
    """``limited``, its message acknowledged before it runs (Celery's default)."""
    record(self, i=i)
    return i


def zero(*_: Any, **__: Any) -> int:
    return 0


def not_a_string(*_: Any, **__: Any) -> object:
    return None


def units_from_a_lookup(*_: Any, **__: Any) -> int:
    raise LookupError("no price for this endpoint")


@app.task(base=RateLimitedTask, ratelimit=Limit("5/s", key="c", cost=zero), bind=True)
def zero_cost(self: Any, i: int) -> int:
    record(self, i=i)
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit("5/s", key="c", cost=units_from_a_lookup))
def cost_raises(i: int) -> int:
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit("5/s", key=not_a_string), bind=True)
def bad_key_function(self: Any, i: int) -> int:
    record(self, i=i)
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit("5/s", key="t:{0}:{1}"), bind=True)
def too_few_arguments(self: Any, *args: Any) -> int:
    record(self)
    return len(args)


install(app)
