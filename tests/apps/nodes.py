"""The Celery app the worker-node tests start (``celery -A tests.apps.nodes worker``).

Configured from the environment by the test that starts the nodes:
CRL_BROKER, CRL_BACKEND, CRL_REDIS (limiter), CRL_PREFIX, CRL_RATE, CRL_RESERVE,
CRL_QUEUE (default queue name), CRL_PARK_AFTER ("none", seconds; default "auto"),
CRL_MAX_COUNTDOWN (``ratelimit_max_countdown``, seconds).
Every task records its execution (Redis TIME taken inside the task) in the list
``{CRL_PREFIX}:runs`` so the test can check the windows afterwards; every message a
node receives with an ETA is noted in ``{CRL_PREFIX}:held`` (seconds until that ETA).
"""

from __future__ import annotations

import datetime
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

import redis
from celery import Celery, shared_task, signals

from celery_ratelimit import (
    Concurrency,
    Limit,
    RateLimitedTask,
    UpstreamRateLimited,
    install,
    observe,
    ratelimit,
    settle,
)
from tests.measure import server_us

BROKER = os.environ.get("CRL_BROKER", "redis://127.0.0.1:6379/15")
REDIS = os.environ.get("CRL_REDIS", BROKER)
PREFIX = os.environ.get("CRL_PREFIX", "crl")
RATE = os.environ.get("CRL_RATE", "10/s")
PARK = os.environ.get("CRL_PARK_AFTER", "auto")
#: Units per window of the "llm" key; a call is counted at 10 (an estimate) and
#: settled at the units it used.
LLM_RATE = "30/2s"

app = Celery("nodes", broker=BROKER, backend=os.environ.get("CRL_BACKEND") or None)
app.conf.update(
    ratelimit_redis_url=REDIS,
    ratelimit_key_prefix=PREFIX,
    ratelimit_reserve=os.environ.get("CRL_RESERVE", "1") == "1",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("CRL_QUEUE", "celery"),
    ratelimit_park_after=None if PARK == "none" else PARK if PARK == "auto" else float(PARK),
    ratelimit_rules={
        "tests.apps.nodes.via_rules": Limit(RATE, key="shared"),
        "tests.apps.nodes.reads_request_by_rules": Limit("1/s", key="reads-request:rules"),
        # a typo no task's name matches: each node says so when it starts
        "tests.apps.nodes.via_rule": Limit(RATE, key="shared"),
        "tests.apps.nodes.shared_*": Limit(RATE, key="shared"),
        "tests.apps.nodes.slotted_by_rules": Concurrency(2, key="slots"),
        "tests.apps.nodes.llm_by_rules": Limit(LLM_RATE, key="llm", cost=10),
        "tests.apps.nodes.tiered_by_rules": Limit(
            lambda tier, i: tier_rate(tier, i), key="tier:{tier}"
        ),
    },
)
if os.environ.get("CRL_MAX_COUNTDOWN"):
    app.conf.ratelimit_max_countdown = float(os.environ["CRL_MAX_COUNTDOWN"])
_client: redis.Redis | None = None


def record(task: Any, **extra: Any) -> int:
    """Append this execution to the runs list; returns Redis TIME in microseconds.

    Called first thing in a body: ``started`` is this machine's clock then (the
    limiter's redis-server runs on the same machine, so it is Redis's clock too), read
    before anything that could yield to another greenlet; ``t`` is Redis ``TIME``,
    read after connecting."""
    started = time.time_ns() // 1000
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS)
    now = server_us(_client)
    # `is not None`, not truth: a Decision is falsy unless `allowed`, and a task that
    # waited in process for its reserved slot runs on a `reserved` (not allowed) one
    decision = getattr(task.request, "ratelimit_decision", None)
    _client.rpush(
        f"{PREFIX}:runs",
        json.dumps(
            {
                "id": task.request.id,
                "task": task.name,
                "t": now,
                "started": started,
                "granted": int(decision.at * 1_000_000) if decision is not None else None,
                "deferrals": getattr(task.request, "ratelimit_deferrals", 0) or 0,
                "denials": getattr(task.request, "ratelimit_denials", 0) or 0,
                "token": decision.token if decision is not None else None,
                "retries": task.request.retries,
                "hostname": task.request.hostname,
                # the message's own headers (ours left out), and its stamps
                "headers": {
                    k: v
                    for k, v in (task.request.headers or {}).items()
                    if not k.startswith("ratelimit_")
                },
                "stamps": getattr(task.request, "stamps", None) or {},
                **extra,
            }
        ),
    )
    return now


@signals.task_received.connect
def note_held(request: Any = None, **_: Any) -> None:
    """How long this node holds the message before it is due (its ETA, on this clock)."""
    eta = request.eta
    if not isinstance(eta, datetime.datetime):
        return
    global _held_client  # the consumer's own: a pool's processes have `_client`
    if _held_client is None:
        _held_client = redis.Redis.from_url(REDIS)
    ahead = (eta - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    _held_client.rpush(f"{PREFIX}:held", json.dumps({"id": request.id, "ahead": ahead}))


_held_client: redis.Redis | None = None


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="shared"), bind=True)
def via_base(self: Any, i: int) -> int:
    record(self, i=i)
    return i


def request_read(task: Any) -> dict[str, Any]:
    """What the README says a body reads of its request, read as attributes (no
    ``getattr`` default): its deferrals and the Decision that let it run."""
    decision = task.request.ratelimit_decision
    return {
        "deferrals": task.request.ratelimit_deferrals,
        "decision": type(decision).__name__,
        "allowed_or_reserved": bool(decision.allowed or decision.reserved),
    }


@app.task(base=RateLimitedTask, ratelimit=Limit("1/s", key="reads-request:base"), bind=True)
def reads_request_by_base(self: Any) -> dict[str, Any]:
    return request_read(self)


@ratelimit("1/s", key="reads-request:decorator")
@app.task(bind=True)
def reads_request_by_decorator(self: Any) -> dict[str, Any]:
    return request_read(self)


@app.task(bind=True)
def reads_request_by_rules(self: Any) -> dict[str, Any]:
    return request_read(self)


#: A paced limit (Limit(burst=...)): 20 per 2 s, at most 2 at once, one every 100 ms.
PACED = Limit("20/2s", key="paced", burst=2)


@app.task(base=RateLimitedTask, ratelimit=PACED, bind=True)
def paced(self: Any, i: int) -> int:
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


def tier_rate(tier: str, i: int) -> str:
    """A budget per tier (a rate function of the call's arguments)."""
    return "2/s" if tier == "free" else "6/s"


@app.task(base=RateLimitedTask, ratelimit=Limit(tier_rate, key="tier:{tier}"), bind=True)
def tiered(self: Any, tier: str, i: int) -> int:
    record(self, i=i, tier=tier)
    return i


@ratelimit(tier_rate, key="tier:{tier}")
@app.task(bind=True)
def tiered_by_decorator(self: Any, tier: str, i: int) -> int:
    record(self, i=i, tier=tier)
    return i


@app.task(bind=True)
def tiered_by_rules(self: Any, tier: str, i: int) -> int:
    record(self, i=i, tier=tier)
    return i


#: The fair-shares task's limit: tenants share 5/s, slots go to them in turn when they wait.
FAIR_RATE = "5/s"


@app.task(
    base=RateLimitedTask,
    ratelimit=Limit(FAIR_RATE, key="provider", fair_key="{tenant}"),
    bind=True,
)
def fair_tenant(self: Any, tenant: str, i: int) -> int:
    return record(self, i=i, tenant=tenant)


@app.task(
    base=RateLimitedTask,
    ratelimit=[Limit("20/s", key="cal"), Limit("4/m", key="cal", align="UTC")],
    bind=True,
)
def aligned(self: Any, i: int) -> int:
    """At most 4 starts in each minute of the UTC clock (and 20 in any second)."""
    return record(self, i=i)


@app.task(base=RateLimitedTask, ratelimit=Limit(LLM_RATE, key="llm", cost=10), bind=True)
def llm(self: Any, i: int, used: int) -> int:
    """Counted at 10 units before the body, settled at ``used`` once it is known."""
    settled = settle(used)
    return record(self, i=i, used=used, settled=bool(settled and settled.allowed))


@ratelimit(LLM_RATE, key="llm", cost=10)
@app.task(bind=True)
def llm_by_decorator(self: Any, i: int, used: int) -> int:
    settled = settle(used)
    return record(self, i=i, used=used, settled=bool(settled and settled.allowed))


@app.task(bind=True)
def llm_by_rules(self: Any, i: int, used: int) -> int:
    settled = settle(used)
    return record(self, i=i, used=used, settled=bool(settled and settled.allowed))


@app.task(bind=True)
def unlimited(self: Any, i: int) -> int:
    record(self, i=i)
    return i


def units_of(units: int, *_: Any, **__: Any) -> int:
    """Cost of one ``weighted`` call in quota units."""
    return units


#: A units quota and a per-call cap, checked together (one hash tag: "quota").
QUOTA = Limit("40/2s", key="quota", cost=units_of)
CAP = Limit("3/s", key="quota:search")


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="api:{tenant}"), bind=True)
def per_tenant(self: Any, tenant: str, i: int) -> str:
    record(self, i=i, tenant=tenant)
    return f"{tenant}:{i}"


@app.task(base=RateLimitedTask, ratelimit=[QUOTA, CAP], bind=True)
def weighted(self: Any, units: int, i: int) -> int:
    record(self, i=i, units=units)
    return units


#: Members of chains, groups and chords; slow enough to be deferred.
MATH = Limit("4/s", key="math")


@app.task(base=RateLimitedTask, ratelimit=MATH, bind=True)
def add(self: Any, x: int, y: int) -> int:
    record(self, x=x, y=y)
    return x + y


@ratelimit(MATH)
@app.task(bind=True)
def total(self: Any, values: list[int]) -> int:
    record(self, values=values)
    return sum(values)


@app.task(base=RateLimitedTask, ratelimit=Limit("5/s", key="t:{missing}"), bind=True)
def missing_argument(self: Any, i: int, **options: Any) -> int:
    """Its key names a keyword that only some calls pass (``missing=...``)."""
    record(self, i=i)
    return i


#: Deferred several times, and retrying on its own once: deferrals must not count.
FLAKY = Limit("2/s", key="flaky")


@app.task(base=RateLimitedTask, ratelimit=FLAKY, bind=True, max_retries=1, default_retry_delay=0)
def flaky(self: Any, i: int) -> str:
    """Fails its first real run and retries itself once (plain Celery ``self.retry``)."""
    record(self, i=i)
    if self.request.retries == 0:
        raise self.retry(exc=RuntimeError("first run fails"))
    return f"ok after {self.request.retries} retry"


#: One call per 3 s: a test moves a start so as to push a reserved slot later.
PUSHED = Limit("1/3s", key="pushed")


@app.task(base=RateLimitedTask, ratelimit=PUSHED, bind=True)
def pushed(self: Any, i: int) -> int:
    record(self, i=i)
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit("1/s", key="expiring"), bind=True)
def expiring(self: Any, i: int) -> int:
    record(self, i=i)
    return i


def finish(task: Any, **extra: Any) -> None:
    """Note in ``{CRL_PREFIX}:ends`` when this body ended (Redis TIME, µs)."""
    assert _client is not None  # record() ran first
    end = {"id": task.request.id, "t": server_us(_client), **extra}
    _client.rpush(f"{PREFIX}:ends", json.dumps(end))


#: How long a body holding a concurrency slot runs (seconds).
BODY = float(os.environ.get("CRL_BODY", "0.3"))
SLOTS = Concurrency(2, key="slots")


def hold_slot(task: Any, i: int, body: float = BODY) -> int:
    """A body of ``body`` seconds: its start and end recorded."""
    record(task, i=i)
    time.sleep(body)
    finish(task)
    return i


@app.task(base=RateLimitedTask, ratelimit=SLOTS, bind=True)
def slotted(self: Any, i: int) -> int:
    return hold_slot(self, i)


@app.task(base=RateLimitedTask, ratelimit=SLOTS, bind=True)
def slotted_for(self: Any, i: int, body: float) -> int:
    """A body of ``body`` seconds holding a slot of SLOTS."""
    return hold_slot(self, i, body)


@ratelimit(SLOTS)
@app.task(bind=True)
def slotted_by_decorator(self: Any, i: int) -> int:
    return hold_slot(self, i)


@app.task(bind=True)
def slotted_by_rules(self: Any, i: int) -> int:
    return hold_slot(self, i)


@app.task(base=RateLimitedTask, ratelimit=SLOTS, bind=True)
def slotted_failing(self: Any, i: int) -> int:
    """Every exit path a body has: success, an exception, a self.retry()."""
    hold_slot(self, i)
    if i % 3 == 1:
        raise ValueError("a failing body")
    if i % 3 == 2 and self.request.retries == 0:
        raise self.retry(countdown=0, max_retries=1)
    return i


@app.task(base=RateLimitedTask, ratelimit=Concurrency(1, key="leased", lease=3), bind=True)
def leased(self: Any, i: int, seconds: float) -> int:
    record(self, i=i)
    time.sleep(seconds)
    finish(self)
    return i


@app.task(
    base=RateLimitedTask,
    ratelimit=[Limit("20/s", key="upstream"), Concurrency(3, key="upstream")],
    bind=True,
)
def calls_upstream(self: Any, i: int, pause: float) -> int:
    """Task 0's first run is answered 429 with a Retry-After of ``pause`` seconds."""
    now = record(self, i=i)
    assert _client is not None
    if i == 0 and _client.set(f"{PREFIX}:429", now, nx=True):
        raise UpstreamRateLimited(str(int(pause)))
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit("20/s", key="adapting", adapt=True), bind=True)
def adapts_upstream(self: Any, i: int) -> int:
    """Task 0's first run is answered 429 (Retry-After: 1): the key's rate is cut."""
    now = record(self, i=i)
    assert _client is not None
    if i == 0 and _client.set(f"{PREFIX}:429", now, nx=True):
        raise UpstreamRateLimited("1")
    return i


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="http:{family}"), bind=True)
def calls_http(self: Any, family: str, i: int, url: str) -> int:
    """Call a real HTTP upstream (tests/upstream.py) and observe its headers; a 429 is
    observed too (its Retry-After pauses the key) and raised as UpstreamRateLimited."""
    record(self, i=i, family=family)
    try:
        with urllib.request.urlopen(f"{url}?task={self.request.id}", timeout=10) as answer:
            observe(answer.headers)
    except urllib.error.HTTPError as exc:
        if exc.code != 429:
            raise
        observe(exc.headers)
        raise UpstreamRateLimited(exc.headers.get("Retry-After")) from None
    return i


install(app)
