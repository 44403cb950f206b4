"""Metrics: Prometheus counters per limit and the ``task-ratelimited`` event, from a
real worker (in this process, so its registry can be read) on a private Redis."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_ratelimit import Limit, RateLimitedTask, UpstreamRateLimited
from celery_ratelimit._celery import metrics as _metrics
from tests.redis_server import RedisServer

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

    events: list[dict[str, Any]] = []
    connection = app.connection_for_read()
    receiver = app.events.Receiver(connection, handlers={"task-ratelimited": events.append})
    listener = threading.Thread(target=receiver.capture, kwargs={"limit": None}, daemon=True)
    listener.start()
    latency_before = (
        prometheus_client.REGISTRY.get_sample_value("celery_ratelimit_decision_seconds_count")
        or 0.0
    )
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, task_events=True):
            time.sleep(0.5)  # the event receiver is bound by now
            for i in range(8):
                work.delay(i)
            deadline = time.monotonic() + 30
            while sample("celery_ratelimit_allowed_total", label) < 8:
                assert time.monotonic() < deadline, "the tasks did not all run"
                time.sleep(0.1)
            time.sleep(0.5)  # the last events arrive
    finally:
        receiver.should_stop = True
        listener.join(5)
        connection.release()
        _metrics._task_events = None  # this process is no worker any more
    allowed = sample("celery_ratelimit_allowed_total", label)
    deferred = sample("celery_ratelimit_deferred_total", label)
    denied = sample("celery_ratelimit_denied_total", label)
    assert allowed == 8
    assert deferred >= 5 and denied >= 5  # 8 calls at 3/s: at least 5 wait
    assert sample("celery_ratelimit_redis_errors_total", label) == 0
    assert sample("celery_ratelimit_reservations", label) == 0  # every slot reserved was used
    latency = prometheus_client.REGISTRY.get_sample_value("celery_ratelimit_decision_seconds_count")
    assert latency - latency_before >= allowed + deferred
    assert len(events) == deferred
    assert {e["key"] for e in events} == {"metrics-api"}
    assert all(e["reserved"] and e["countdown"] > 0 and e["deferrals"] >= 1 for e in events)
    assert {e["type"] for e in events} == {"task-ratelimited"}


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
        deadline = time.monotonic() + 30
        while len(answered) < 2:  # run again after the pause, the rate cut
            assert time.monotonic() < deadline, "the task did not run again"
            time.sleep(0.05)
        assert sample("celery_ratelimit_declared_rate", label) == 20.0
        assert 10.0 <= sample("celery_ratelimit_effective_rate", label) < 20.0
