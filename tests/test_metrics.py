"""Metrics: Prometheus counters per limit and the ``task-ratelimited`` event, from a
real worker (in this process, so its registry can be read) on a private Redis."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_ratelimit import Concurrency, Limit, Limiter, RateLimitedTask, UpstreamRateLimited
from celery_ratelimit._celery import metrics as _metrics
from tests.metrics_nodes import metrics_node
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent

prometheus_client = pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.celery


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.close()


def metrics_app(server: RedisServer, name: str) -> Celery:
    app = Celery(name, broker=server.url, set_as_current=False)
    app.conf.update(
        ratelimit_redis_url=server.url,
        ratelimit_key_prefix="metrics",
        ratelimit_metrics=True,
        worker_hijack_root_logger=False,
    )
    return app


def sample(name: str, limit: str) -> float:
    value = prometheus_client.REGISTRY.get_sample_value(name, {"limit": limit})
    return float(value or 0.0)


def until(done: Callable[[], bool], what: str, seconds: float = 30.0) -> None:
    """Wait until ``done()``; fail saying ``what`` did not happen within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@contextlib.contextmanager
def deferral_events(app: Celery) -> Iterator[list[dict[str, Any]]]:
    """The ``task-ratelimited`` events the app's workers send while in the block (an
    in-process worker started inside it, with task events on)."""
    events: list[dict[str, Any]] = []
    connection = app.connection_for_read()
    receiver = app.events.Receiver(connection, handlers={"task-ratelimited": events.append})
    listener = threading.Thread(target=receiver.capture, kwargs={"limit": None}, daemon=True)
    listener.start()
    try:
        yield events
    finally:
        receiver.should_stop = True
        listener.join(5)
        connection.release()
        _metrics._task_events = None  # this process is no worker any more


def test_a_worker_counts_decisions_per_limit_and_sends_deferral_events(
    server: RedisServer,
) -> None:
    app = metrics_app(server, "metrics_test")
    label = "metrics-api"

    @app.task(
        name="metrics_test.work",
        base=RateLimitedTask,
        ratelimit=Limit("3/s", key="metrics-api", name=label),
    )
    def work(i: int) -> int:
        return i

    @app.task(
        name="metrics_test.held",
        base=RateLimitedTask,
        ratelimit=Limit("3/s", key="metrics-held", name="metrics-held"),
    )
    def held(i: int) -> int:
        return i

    latency_before = (
        prometheus_client.REGISTRY.get_sample_value("celery_ratelimit_decision_seconds_count")
        or 0.0
    )
    with (
        deferral_events(app) as events,
        start_worker(app, pool="solo", perform_ping_check=False, task_events=True),
    ):
        time.sleep(0.5)  # the event receiver is bound by now
        Limiter.from_url(server.url, prefix=app.conf.ratelimit_key_prefix).pause(
            "metrics-held", 1.0
        )
        held.delay(0)
        for i in range(8):
            work.delay(i)
        until(lambda: sample("celery_ratelimit_allowed_total", label) >= 8, "8 tasks ran")
        until(lambda: sample("celery_ratelimit_allowed_total", "metrics-held") >= 1, "held ran")
        time.sleep(0.5)  # the last events arrive
    allowed = sample("celery_ratelimit_allowed_total", label)
    deferred = sample("celery_ratelimit_deferred_total", label)
    denied = sample("celery_ratelimit_denied_total", label)
    assert allowed == 8
    assert deferred >= 5 and denied >= 5  # 8 calls at 3/s: at least 5 wait
    assert sample("celery_ratelimit_redis_errors_total", label) == 0
    assert sample("celery_ratelimit_reservations", label) == 0  # every slot reserved was used
    # the last slot reserved: when the backlog drained, by the limiter's Redis clock
    drained = sample("celery_ratelimit_backlog_drains_at_seconds", label)
    seconds, micros = server.client().time()
    assert 0 < seconds + micros / 1e6 - drained < 30
    latency = prometheus_client.REGISTRY.get_sample_value("celery_ratelimit_decision_seconds_count")
    assert latency - latency_before >= allowed + deferred
    limited = [e for e in events if e["key"] == "metrics-api"]
    paused = [e for e in events if e["key"] == "metrics-held"]
    assert len(limited) == deferred and len(limited) + len(paused) == len(events)
    assert all(e["reserved"] and e["countdown"] > 0 and e["deferrals"] >= 1 for e in limited)
    assert {e["type"] for e in events} == {"task-ratelimited"}
    # what each deferral waited for: the limit's budget, or the key's pause
    assert {e["why"] for e in limited} == {"limit"}
    assert paused and {e["why"] for e in paused} == {"paused"}


def test_metrics_are_off_and_prometheus_client_unimported_by_default() -> None:
    probe = (
        "import sys\n"
        "from celery import Celery\n"
        "import celery_ratelimit\n"
        "from celery_ratelimit._celery.metrics import metrics_for\n"
        "app = Celery('x')\n"
        "assert metrics_for(app) is None\n"
        "print('prometheus_client' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_an_adapting_limit_exports_its_declared_and_effective_rates(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_metrics, "RATE_REFRESH", 0.0)
    app = metrics_app(server, "metrics_adapt")
    label = "metrics-adapting"
    answered: list[int] = []

    @app.task(
        name="metrics_adapt.call",
        base=RateLimitedTask,
        ratelimit=Limit("20/s", key="metrics-adapting", name=label, adapt=True),
    )
    def call(i: int) -> int:
        answered.append(i)
        if len(answered) == 1:  # the upstream's first answer is a 429
            raise UpstreamRateLimited(0.05)
        return i

    with start_worker(app, pool="solo", perform_ping_check=False):
        call.delay(0)
        # run again after the pause, the rate cut
        until(lambda: len(answered) >= 2, "the task ran again")
        assert sample("celery_ratelimit_declared_rate", label) == 20.0
        assert 10.0 <= sample("celery_ratelimit_effective_rate", label) < 20.0


def families(text: str) -> dict[tuple[str, str], float]:
    """(sample name, its limit label) -> value, from an exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, s.labels.get("limit", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize(
    ("pool", "concurrency"), [("prefork", 2), ("gevent", 20), ("eventlet", 20)]
)
def test_a_node_serves_every_pool_process_by_the_documented_recipe(
    server: RedisServer, tmp_path: Path, pool: str, concurrency: int
) -> None:
    """A node started with the recipe of docs/operations.md serves what its pool
    counted: every task allowed once, no reservation left, the deferrals of 8 calls at
    4/s. On prefork, what its two pool processes counted; on the green pools, what one
    process counted, served by the recipe's HTTP thread under the pool's monkey patch."""
    label = "metrics-node-api"  # tests.apps.metrics_node's (not imported: its recipe
    # would serve this process's metrics from any worker the tests start in it)
    with metrics_node(server.url, server.url, tmp_path, pool, concurrency) as node:
        sender = Celery("metrics_sender", broker=server.url, set_as_current=False)
        for i in range(8):
            sender.send_task("tests.apps.metrics_node.call", args=(i,))
        client = server.client()
        until(lambda: client.llen(f"{node.prefix}:runs") >= 8, "8 tasks ran", 60)
        time.sleep(0.3)  # the last task's counts are written as it ends
        with urllib.request.urlopen(f"http://127.0.0.1:{node.port}/metrics", timeout=10) as r:
            seen = families(r.read().decode())
    assert seen[("celery_ratelimit_allowed_total", label)] == 8
    assert seen[("celery_ratelimit_deferred_total", label)] >= 4  # 8 calls at 4/s
    assert seen.get(("celery_ratelimit_reservations", label), 0.0) == 0
    assert seen[("celery_ratelimit_backlog_drains_at_seconds", label)] > 0  # slots were reserved
    assert seen[("celery_ratelimit_decision_seconds_count", "")] >= 8
    # read by the node's main process (no label: one series each, whatever the keys)
    for gauge in ("parked", "paused_keys", "overrides"):
        assert (f"celery_ratelimit_{gauge}", "") in seen


def test_a_grant_read_late_on_a_busy_hub_is_counted_as_a_late_start(
    server: RedisServer, tmp_path: Path
) -> None:
    """On a gevent node, a body that holds the hub for 0.3 s without yielding makes the
    next greenlet wake that late from its wait for a paced start 100 ms ahead: its grant
    is started anew (restamped) and counted in ``celery_ratelimit_late_starts_total``;
    every task still runs once."""
    label = "metrics-node-paced"
    with metrics_node(server.url, server.url, tmp_path, "gevent", 20) as node:
        sender = Celery("metrics_sender", broker=server.url, set_as_current=False)
        for i in range(4):
            sender.send_task("tests.apps.metrics_node.spin", args=(i,))
        client = server.client()
        until(lambda: client.llen(f"{node.prefix}:runs") >= 4, "4 tasks ran", 60)
        time.sleep(0.3)
        with urllib.request.urlopen(f"http://127.0.0.1:{node.port}/metrics", timeout=10) as r:
            seen = families(r.read().decode())
    ran = sorted(client.lrange(f"{node.prefix}:runs", 0, -1))
    assert ran == [f"s{i}".encode() for i in range(4)], ran
    assert seen[("celery_ratelimit_allowed_total", label)] == 4
    assert seen[("celery_ratelimit_late_starts_total", label)] >= 1


def test_a_concurrency_limit_counts_every_body_and_leaves_no_reservation(
    server: RedisServer,
) -> None:
    """Four calls of Concurrency(1) on a threads pool: the waiting ones are handed their
    turn or confirm it; each that ran is counted allowed once, and every reservation made
    for a waiting call leaves the gauge when it runs."""
    app = metrics_app(server, "metrics_conc")
    label = "metrics-conc"
    spans: list[tuple[float, float]] = []

    @app.task(
        name="metrics_conc.body",
        base=RateLimitedTask,
        ratelimit=Concurrency(1, key="metrics-conc", name=label),
    )
    def body(i: int) -> int:
        begun = time.monotonic()
        time.sleep(0.3)
        spans.append((begun, time.monotonic()))
        return i

    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        for i in range(4):
            body.delay(i)
        until(lambda: len(spans) >= 4, "the 4 bodies ran")
        time.sleep(0.2)
    ordered = sorted(spans)
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(ordered))
    assert sample("celery_ratelimit_allowed_total", label) == 4
    assert sample("celery_ratelimit_reservations", label) == 0


def test_an_outage_shows_as_redis_deferrals_errors_and_latency(server: RedisServer) -> None:
    """The limiter's Redis down (the broker up): each deferral's event says why="redis",
    every failed decision is counted and timed; back up, every task runs once."""
    limiter_redis = RedisServer()
    app = Celery("metrics_outage", broker=server.url, set_as_current=False)
    app.conf.update(
        ratelimit_redis_url=limiter_redis.url,
        ratelimit_key_prefix="metrics",
        ratelimit_metrics=True,
        ratelimit_redis_error_countdown=0.3,
        worker_hijack_root_logger=False,
    )
    label = "metrics-outage"
    ran: list[int] = []

    @app.task(
        name="metrics_outage.call",
        base=RateLimitedTask,
        ratelimit=Limit("100/s", key="metrics-outage", name=label),
    )
    def call(i: int) -> int:
        ran.append(i)
        return i

    latency = "celery_ratelimit_decision_seconds_count"
    latency_before = prometheus_client.REGISTRY.get_sample_value(latency) or 0.0
    try:
        with (
            deferral_events(app) as events,
            start_worker(app, pool="threads", perform_ping_check=False, task_events=True),
        ):
            time.sleep(0.5)  # the event receiver is bound by now
            limiter_redis.stop()
            for i in range(2):
                call.delay(i)
            errors = "celery_ratelimit_redis_errors_total"
            until(lambda: sample(errors, label) >= 4, "4 failed decisions were counted")
            assert not ran  # deferred while Redis is down, never run unlimited
            limiter_redis.start()
            until(lambda: len(ran) >= 2, "the tasks ran after the outage")
            time.sleep(0.5)  # the last events arrive
    finally:
        limiter_redis.close()
    errors = sample("celery_ratelimit_redis_errors_total", label)
    timed = (prometheus_client.REGISTRY.get_sample_value(latency) or 0.0) - latency_before
    assert sorted(ran) == [0, 1]
    assert sample("celery_ratelimit_allowed_total", label) == 2
    assert timed >= errors + 2  # every failed decision, and the two that let the tasks run
    outage = [e for e in events if e["why"] == "redis"]
    assert len(outage) >= 4 and all(not e["reserved"] for e in outage)
    assert {e["why"] for e in events} == {"redis"}


def test_park_depth_paused_keys_and_overrides_are_counted_through_every_door(
    server: RedisServer,
) -> None:
    """The three gauges read what Redis holds, whichever door wrote it: a pause by
    Limiter.pause, by the CLI and by an upstream's Retry-After; an override by Limiter
    and by the CLI; a copy parked. A lapsed pause, a resume and an unset leave them."""
    from celery_ratelimit._celery.gauges import read_gauges
    from celery_ratelimit._celery.park import move_once, park
    from celery_ratelimit._celery.settings import limiter_for
    from celery_ratelimit._tools.cli import main as cli

    app = metrics_app(server, "gauges")

    @app.task(base=RateLimitedTask, ratelimit=Limit("10/s", key="api:{tenant}"), name="g.t")
    def t(tenant: str) -> None:
        pass

    limiter = limiter_for(app)
    door = ["--url", server.url, "--prefix", "metrics"]
    limiter.pause("api:t1", 30)
    assert cli(["pause", "api:t2", "30", *door]) == 0
    limiter.observe("api:t3", {"Retry-After": "30"}, Limit("10/s"))
    limiter.pause("api:t4", 0.2)  # lapses before the read below
    limiter.override("api:t1", "5/s", ttl=60)
    assert cli(["set", "api:t5", "7/s", *door]) == 0
    move_once(app)  # a mover serves the park
    assert park(t, t.signature(("t1",)), 30.0)
    time.sleep(0.3)
    assert read_gauges(app) == {"parked": 1, "paused_keys": 3, "overrides": 2}
    # an index lapses with its last pause; one that holds a lasting override does not
    assert 0 < limiter.client.pttl("metrics:{index}:paused") <= 31_000
    assert limiter.client.pttl("metrics:{index}:overrides") == -1
    assert prometheus_client.REGISTRY.get_sample_value("celery_ratelimit_paused_keys") == 3
    assert prometheus_client.REGISTRY.get_sample_value("celery_ratelimit_overrides") == 2
    assert prometheus_client.REGISTRY.get_sample_value("celery_ratelimit_parked") == 1
    assert cli(["resume", "api:t2", *door]) == 0
    assert cli(["unset", "api:t5", *door]) == 0
    limiter.override("api:t1", None)
    assert read_gauges(app) == {"parked": 1, "paused_keys": 2, "overrides": 0}
    # the asyncio door writes the same indexes
    asyncio.run(_async_door(server.url))
    assert read_gauges(app) == {"parked": 1, "paused_keys": 2, "overrides": 1}


async def _async_door(url: str) -> None:
    from celery_ratelimit import AsyncLimiter

    limiter = AsyncLimiter.from_url(url, prefix="metrics")
    try:
        await limiter.pause("api:t6", 30)
        await limiter.override("api:t6", "3/s", ttl=30)
        await limiter.resume("api:t1")
        await limiter.observe("api:t7", {"Retry-After": "30"}, Limit("10/s"))
        await limiter.resume("api:t7")
    finally:
        await getattr(limiter.client, "aclose", limiter.client.close)()
