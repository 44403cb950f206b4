"""The Celery app of the end-to-end benchmarks (``celery -A benchmarks.bench_app worker``).

Configured from the environment by benchmarks/bench_celery.py: CRL_BENCH_BROKER,
CRL_BENCH_REDIS (the limiter's own redis-server, so its command counts are ours only),
CRL_BENCH_RATE, CRL_BENCH_PARK_AFTER ("auto", "none" or seconds), CRL_BENCH_SETTINGS
(more ``app.conf`` settings, a JSON object), CRL_BENCH_FLOOD_RATE (the limit of
``flood``, default CRL_BENCH_RATE), CRL_BENCH_FLOOD_TRACE (``flood`` rows get their
decision's timeline too). Each task appends
``"<started_us> <granted_us> <deferrals>"`` (then the tenant, for the fair-shares
tasks) to ``bench:runs:<task>`` on the limiter's Redis.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

import redis
from celery import Celery

from benchmarks.bench_limiter import floor_script
from celery_ratelimit import (
    Concurrency,
    Limit,
    Rate,
    RateLimitedTask,
    UpstreamRateLimited,
    observe,
)
from celery_ratelimit._celery import clock as _clock
from celery_ratelimit._engine.client import HeldConnection

BROKER = os.environ.get("CRL_BENCH_BROKER", "redis://127.0.0.1:6379/1")
REDIS = os.environ.get("CRL_BENCH_REDIS", "redis://127.0.0.1:6379/0")
RATE = os.environ.get("CRL_BENCH_RATE", "20/s")
PARK_AFTER = os.environ.get("CRL_BENCH_PARK_AFTER", "auto")

app = Celery("bench", broker=BROKER)
app.conf.update(
    ratelimit_redis_url=REDIS,
    ratelimit_key_prefix="bench",
    ratelimit_park_after=(
        None if PARK_AFTER == "none" else PARK_AFTER if PARK_AFTER == "auto" else float(PARK_AFTER)
    ),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
app.conf.update(json.loads(os.environ.get("CRL_BENCH_SETTINGS") or "{}"))
_client: redis.Redis | None = None
#: the bounds' round trips go the way the limiter's do: on a connection held for them
_held: HeldConnection | None = None


def record(task: Any, tag: str = "") -> int:
    """The body's start, read from this process's clock moved to Redis time (the offset
    the library keeps; every node shares the machine's clock here). A ``TIME`` call
    would stamp when the limiter's redis-server answered: on a loaded VM that server
    is sometimes descheduled for 50-100 ms, and the bodies that asked it meanwhile were
    stamped together at its return, as if they had started bunched."""
    global _client, _held
    now = int((time.time() + (_clock._offset or 0.0)) * 1_000_000)
    if _client is None:
        _client = redis.Redis.from_url(REDIS)
        _held = HeldConnection.for_client(_client)
    decision = getattr(task.request, "ratelimit_decision", None)
    granted = int(decision.at * 1_000_000) if decision else now
    deferrals = getattr(task.request, "ratelimit_deferrals", 0) or 0
    line = f"{now} {granted} {deferrals}" + (f" {tag}" if tag else "")
    _client.rpush(f"bench:runs:{task.name.rsplit('.', 1)[-1]}", line)
    return now


#: The fair-shares benchmark's weights (bench_fair): "heavy" counts three times.
FAIR_WEIGHTS = {"heavy": 3}


def fair_weight(tenant: str) -> float:
    return FAIR_WEIGHTS.get(tenant, 1)


@app.task(
    base=RateLimitedTask,
    ratelimit=Limit(RATE, key="fair", fair_key="{tenant}", fair_weight=fair_weight),
    bind=True,
)
def fair_tenant(self: Any, tenant: str) -> None:
    """Tenants sharing one budget in fair shares (bench_fair)."""
    record(self, tenant)


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="fifo"), bind=True)
def fifo_tenant(self: Any, tenant: str) -> None:
    """The same budget without a fair key: slots in arrival order (bench_fair's anchor)."""
    record(self, tenant)


@app.task(base=RateLimitedTask, ratelimit=Limit(RATE, key="reserved"), bind=True)
def reserved(self: Any) -> None:
    """Ours, deferred tasks reserve their slot (the default)."""
    record(self)


@app.task(
    base=RateLimitedTask,
    ratelimit=Limit(RATE, key="unreserved"),
    ratelimit_reserve=False,
    bind=True,
)
def unreserved(self: Any) -> None:
    """Ours, plain retry-after deferral."""
    record(self)


@app.task(
    base=RateLimitedTask,
    ratelimit=Limit(RATE, key="unchecked"),
    ratelimit_guard=0,
    bind=True,
)
def unchecked(self: Any) -> None:
    """An anchor: ours with ``ratelimit_guard=0``, whose grants are exact and whose
    starts are not checked (a grant read late is run late)."""
    record(self)


@app.task(rate_limit=RATE, bind=True)
def celery_rate_limit(self: Any) -> None:
    """The anchor: Celery's own per-node token bucket."""
    record(self)


@app.task(base=RateLimitedTask, ratelimit=Limit("1000000/s", key="loose"), bind=True)
def loose(self: Any) -> None:
    """Ours with a limit far above the load: the library's overhead only."""
    record(self)


@app.task(bind=True)
def unlimited(self: Any) -> None:
    """The same task without the library."""
    record(self)


@app.task(bind=True)
def one_round_trip(self: Any) -> None:
    """The bound: the same task plus one PING to the limiter's Redis, i.e. what any
    shared limit costs at least (one round trip before the body), with no script."""
    record(self)
    assert _held is not None
    _held.call("PING")


_noop_sha: str | None = None


@app.task(bind=True)
def one_script_call(self: Any) -> None:
    """The bound of any limiter in a Lua script: the same task plus one EVALSHA of a
    script that does nothing (``return 1``)."""
    global _noop_sha
    record(self)
    assert _client is not None and _held is not None
    if _noop_sha is None:
        _noop_sha = _client.script_load("return 1")
    _held.call("EVALSHA", _noop_sha, 0)


#: The least an exact decision does (benchmarks.bench_limiter's floor script), here
#: pruning a 1 s log, the window of ``loose``.
FLOOR_SCRIPT = floor_script(1_000_000)
_floor_sha: str | None = None


@app.task(bind=True)
def one_floor_call(self: Any) -> None:
    """The bound of any exact limiter in a Lua script: the same task plus one EVALSHA of
    the floor script on a log of its own, as ``loose`` keeps one."""
    global _floor_sha
    record(self)
    assert _client is not None and _held is not None
    if _floor_sha is None:
        _floor_sha = _client.script_load(FLOOR_SCRIPT)
    _held.call("EVALSHA", _floor_sha, 1, "bench:floor", os.urandom(8))


#: Row 12: bodies of BODY seconds under Concurrency(2), shared by every node.
BODY = float(os.environ.get("CRL_BENCH_BODY", "0.2"))


def hold_body(task: Any, body: float = BODY, key: str = "slots") -> None:
    """A body of ``body`` seconds holding a slot of ``key``: the slots Redis holds as it
    starts go to ``bench:holders`` and its span to ``bench:spans``."""
    start = record(task)
    assert _client is not None
    # the slots held as Redis has them when this body starts (the invariant: at most 2)
    _client.rpush("bench:holders", _client.zcard(f"bench:{{{key}}}:conc:0:s"))
    time.sleep(body)
    end = int((time.time() + (_clock._offset or 0.0)) * 1_000_000)
    _client.rpush("bench:spans", f"{start} {end}")


@app.task(base=RateLimitedTask, ratelimit=Concurrency(2, key="slots"), bind=True)
def slotted(self: Any, key: str = "") -> None:
    """A body holding a slot for BODY seconds; its span goes to ``bench:spans``."""
    hold_body(self)


@app.task(base=RateLimitedTask, ratelimit=Concurrency(2, key="uneven"), bind=True)
def uneven(self: Any, body: float) -> None:
    """A body of ``body`` seconds under Concurrency(2) (bench_handoff)."""
    hold_body(self, body, "uneven")


@app.task(
    base=RateLimitedTask,
    ratelimit=[Limit("100/s", key="upstream"), Concurrency(4, key="upstream")],
    bind=True,
)
def upstream(self: Any, pause: float = 0.0) -> None:
    """The first call given a ``pause`` is answered 429 (Retry-After: pause)."""
    now = record(self)
    assert _client is not None
    if pause and _client.set("bench:429", now, nx=True):
        raise UpstreamRateLimited(pause)


@app.task(bind=True)
def plain_body(self: Any) -> None:
    """The anchor of row 12: the same body, no limit (one node of -c 2 caps it)."""
    hold_body(self)


#: Row 9b: the first Redis command of a body, stamped by the server as it runs it.
STAMP_SCRIPT = (
    "local t = redis.call('TIME') "
    "local io = t[1] .. string.format('%06d', t[2]) "
    "redis.call('RPUSH', KEYS[1], ARGV[1] .. ' ' .. io .. ' ' .. ARGV[2]) "
    "return 1"
)


#: Row 9b's task may be declared with a margin (``10/1.1s``), which Celery's own
#: ``rate_limit`` of the anchor task could not parse.
FLOOD_RATE = os.environ.get("CRL_BENCH_FLOOD_RATE") or RATE
#: CRL_BENCH_FLOOD_TRACE=1: each flood row also gets its last decision's local send and
#: reply-read instants (Redis time, µs): the timeline of row 9b's analysis.
FLOOD_TRACE = bool(os.environ.get("CRL_BENCH_FLOOD_TRACE"))
_traced: dict[str, tuple[float, float]] = {}

if FLOOD_TRACE:
    from celery_ratelimit._celery import path as _path

    _ask = _path.Path.ask

    def _traced_decide(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent = time.time()
        decision = _ask(self, *args, **kwargs)
        _traced[self.request.id] = (sent, time.time())
        return decision

    _path.Path.ask = _traced_decide  # type: ignore[method-assign]


@app.task(base=RateLimitedTask, ratelimit=Limit(FLOOD_RATE, key="flood"), bind=True)
def flood(self: Any) -> None:
    """A body whose first line and first I/O are both stamped: ``bench:runs:flood``
    gets ``"<first line> <first I/O> <granted> <deferrals>"``. The line is this
    process's clock moved to Redis time (one machine: Redis's clock); the I/O is
    Redis ``TIME`` inside the script that is the body's first command, i.e. when the
    server ran it, as an upstream would see the body's first request. On a cold
    process that command opens a connection first, as a body's first request would."""
    line = int((time.time() + (_clock._offset or 0.0)) * 1_000_000)
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS)
    decision = getattr(self.request, "ratelimit_decision", None)
    granted = int(decision.at * 1_000_000) if decision is not None else line
    deferrals = getattr(self.request, "ratelimit_deferrals", 0) or 0
    more = ""
    if FLOOD_TRACE:
        offset = _clock._offset or 0.0
        sent, read = _traced.pop(self.request.id, (0.0, 0.0))
        more = f" {int((sent + offset) * 1e6)} {int((read + offset) * 1e6)} {os.getpid()}"
    _client.eval(STAMP_SCRIPT, 1, "bench:runs:flood", line, f"{granted} {deferrals}{more}")


#: The upstream of the bench_upstream scenarios (tests/upstream.py) and the rate the
#: tasks declare (twice what it allows, as when a provider lowers a plan).
UPSTREAM = os.environ.get("CRL_BENCH_UPSTREAM", "http://127.0.0.1:1")
DECLARED = os.environ.get("CRL_BENCH_DECLARED", "40/s")


def call_upstream(task: Any, path: str, read_headers: bool) -> None:
    """One call of the upstream; its headers observed when ``read_headers``; a 429
    raised as UpstreamRateLimited with its Retry-After."""
    url = f"{UPSTREAM}/{path}?task={task.request.id}"
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            if read_headers:
                observe(answer.headers)
    except urllib.error.HTTPError as exc:
        if exc.code != 429:
            raise
        if read_headers:
            observe(exc.headers)
        raise UpstreamRateLimited(exc.headers.get("Retry-After")) from None


@app.task(base=RateLimitedTask, ratelimit=Limit(DECLARED, key="up:{path}"), bind=True)
def upstream_pause(self: Any, path: str) -> None:
    call_upstream(self, path, read_headers=False)


@app.task(base=RateLimitedTask, ratelimit=Limit(DECLARED, key="up:{path}"), bind=True)
def upstream_observe(self: Any, path: str) -> None:
    call_upstream(self, path, read_headers=True)


@app.task(base=RateLimitedTask, ratelimit=Limit(DECLARED, key="up:{path}", adapt=True), bind=True)
def upstream_adapt(self: Any, path: str) -> None:
    call_upstream(self, path, read_headers=False)


#: Even pacing (``benchmarks/bench_pacing.py``): 20 per 2 s, at most 2 at once, then one
#: per 100 ms; the same window unpaced; throttled-py's GCRA at the same quota and burst.
PACED_RATE, PACED_BURST = "20/2s", 2


@app.task(
    base=RateLimitedTask, ratelimit=Limit(PACED_RATE, key="paced", burst=PACED_BURST), bind=True
)
def paced(self: Any) -> None:
    """Ours, paced."""
    record(self)


@app.task(base=RateLimitedTask, ratelimit=Limit(PACED_RATE, key="windowed"), bind=True)
def windowed(self: Any) -> None:
    """Ours, the same window unpaced."""
    record(self)


_gcra: Any = None


@app.task(bind=True, max_retries=None)
def throttled_gcra(self: Any) -> None:
    """An anchor: throttled-py's GCRA in the body, the usual way to use a limiter library
    from Celery: a denied call retries after the ``retry_after`` it was given."""
    global _gcra
    if _gcra is None:
        import datetime

        from throttled import Throttled, rate_limiter, store

        rate = Rate.parse(PACED_RATE)
        quota = rate_limiter.per_duration(
            datetime.timedelta(microseconds=rate.window_us), limit=rate.limit, burst=PACED_BURST
        )
        _gcra = Throttled(
            key="gcra", using="gcra", quota=quota, store=store.RedisStore(server=REDIS)
        )
    result = _gcra.limit()
    if result.limited:
        raise self.retry(countdown=result.state.retry_after)
    record(self)
