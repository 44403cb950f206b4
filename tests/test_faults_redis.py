"""The limiter's Redis fails under real worker nodes: down, hung, restarted, flushed.

Two nodes (prefork -c 2) of ``tests.apps.faults`` share a limit of 10/s kept in a
private redis-server that the tests stop, pause (SIGSTOP), restart and SCRIPT FLUSH;
the broker and the execution records live on another redis-server, which stays up.
``ratelimit_on_redis_error`` is chosen per call (a message header), so one set of
nodes serves every policy. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_ratelimit import Limiter, LimiterUnavailable
from tests.fault_nodes import Fleet, max_grants, print_on_failure, tally
from tests.nodes import unique_prefix
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.celery, pytest.mark.timeout(240)]

LIMIT, WINDOW_US = 10, 1_000_000
WARN_INTERVAL = 60.0
#: 2 s timeouts, one retry: a hung Redis costs a process's first decision 6 s, later
#: ones 8 s (docs/operations.md).
HUNG_BOUND = 6.0
POLICY_IDS = {"defer": 0, "allow": 1000, "raise": 2000}


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    broker, limiter = RedisServer(), RedisServer()
    limiter.stop()  # down when the workers start
    yield broker, limiter
    broker.close()
    limiter.close()


@pytest.fixture(scope="module")
def module_fleet(
    servers: tuple[RedisServer, RedisServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    broker, limiter = servers
    fleet = Fleet(
        tmp_path_factory.mktemp("faults-redis"),
        broker_url=f"redis://127.0.0.1:{broker.port}/1",
        limiter_url=limiter.url,
        runs_url=f"redis://127.0.0.1:{broker.port}/3",
        prefix=unique_prefix("faults-redis"),
        settings={
            "rate": f"{LIMIT}/s",
            "error_countdown": "0.5",
            "warn_interval": str(WARN_INTERVAL),
        },
    )
    try:
        fleet.add(2)
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def fleet(module_fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    yield module_fleet
    print_on_failure(request, module_fleet)


def send(fleet: Fleet, policy: str, count: int, base: int) -> list[str]:
    headers = {"ratelimit_on_redis_error": policy}
    return [
        fleet.send("limited", base + POLICY_IDS[policy] + i, headers=headers) for i in range(count)
    ]


def failed(fleet: Fleet, ids: list[str]) -> set[str]:
    """Ids of tasks the nodes logged as failed with ``LimiterUnavailable`` (the policy
    ``raise``'s error, not another one)."""
    lines = [line for line in fleet.grep("raised unexpected") if "LimiterUnavailable" in line]
    return {i for i in ids if any(i in line for line in lines)}


def wait_until(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def budget(runs: list[dict[str, object]]) -> int:
    return max_grants(runs, WINDOW_US)


@pytest.fixture
def limiter_redis(servers: tuple[RedisServer, RedisServer]) -> RedisServer:
    """The limiter's Redis, started again if an earlier test left it down."""
    _broker, limiter = servers
    if limiter.proc is None:
        limiter.start()
    return limiter


def allowed_ran_and_raised_failed(
    fleet: Fleet, allow: list[str], fail: list[str], timeout: float
) -> None:
    """Within ``timeout``: every ``allow`` task ran (unlimited), every ``raise`` one failed
    (LimiterUnavailable)."""
    assert wait_until(lambda: {r["id"] for r in fleet.runs()} >= set(allow), timeout)
    assert wait_until(lambda: failed(fleet, fail) == set(fail), timeout)


def ran_once(
    fleet: Fleet, ids: list[str], timeout: float
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The runs of ``ids`` and their tally, once all ran: none lost, none run twice."""
    runs = fleet.wait_for_runs(ids, timeout)
    counts = tally(ids, runs)
    assert counts["lost"] == counts["duplicated"] == 0, counts
    return runs, counts


def test_redis_down_at_worker_start_each_policy_then_back(
    fleet: Fleet, servers: tuple[RedisServer, RedisServer]
) -> None:
    _broker, limiter = servers
    assert limiter.proc is None, "this test runs first: the limiter's Redis is still down"
    sent_at = time.time()
    defer = send(fleet, "defer", 20, 0)
    allow = send(fleet, "allow", 10, 0)
    fail = send(fleet, "raise", 4, 0)
    allowed_ran_and_raised_failed(fleet, allow, fail, 15)
    time.sleep(1.0)
    runs = fleet.runs()
    ran = {r["id"] for r in runs}
    assert not ran & set(defer), "a deferred task ran while its limiter was down"
    assert not ran & set(fail)
    allow_runs = [r for r in runs if r["id"] in allow]
    slowest = max(r["local"] for r in allow_runs) - sent_at
    warnings = fleet.grep("running without its rate limit")
    pids = {(r["hostname"], r["pid"]) for r in allow_runs}
    # one warning per pool process within the interval, never one per task
    assert len(warnings) == len(pids) <= 4 < len(allow)
    # deferring for a Redis that is down is said too, at WARNING, as rarely
    deferring = [line for line in fleet.grep("Redis unavailable") if "deferring" in line]
    assert all("WARNING" in line for line in deferring + warnings)
    assert 1 <= len(deferring) <= 4 < len(defer)
    redis_error_deferrals = len(fleet.grep("; Redis error:"))
    assert redis_error_deferrals >= len(defer)
    # a limiter URL that never answered: each node says so once, at ERROR
    never = fleet.grep("nothing answered")
    assert len(never) == len(fleet.nodes) and all("ERROR" in line for line in never)

    back = time.monotonic()
    limiter.start()
    runs, counts = ran_once(fleet, defer, 20)
    assert budget(runs) <= LIMIT
    assert not failed(fleet, defer)
    print(
        f"\n[down at start] defer: {counts}, Redis-error deferrals {redis_error_deferrals}, "
        f"all ran {time.monotonic() - back:.1f}s after Redis returned, max grants/window "
        f"{budget(runs)}; allow: {len(allow_runs)} ran unlimited (slowest {slowest:.2f}s "
        f"after sending), {len(warnings)} warnings from {len(pids)} processes; "
        f"raise: {len(failed(fleet, fail))}/{len(fail)} failed with LimiterUnavailable"
    )


def test_redis_down_mid_run_each_policy(fleet: Fleet, limiter_redis: RedisServer) -> None:
    limiter = limiter_redis
    never_before = len(fleet.grep("nothing answered"))
    defer = send(fleet, "defer", 30, 100)
    time.sleep(1.2)
    limiter.stop()
    allow = send(fleet, "allow", 6, 100)
    fail = send(fleet, "raise", 4, 100)
    allowed_ran_and_raised_failed(fleet, allow, fail, 15)
    down_runs = len([r for r in fleet.runs() if r["id"] in defer])
    limiter.start()
    runs, counts = ran_once(fleet, defer, 25)
    assert not failed(fleet, defer)
    # a limiter that had answered is down for now: no ERROR about its URL
    assert len(fleet.grep("nothing answered")) == never_before
    # the budget restarts empty with the restarted server: judge each side apart
    grants = sorted(r["granted"] for r in runs if r["granted"] is not None)
    assert all(r["granted"] is not None for r in runs), str(
        [r for r in runs if r["granted"] is None]
    )
    print(
        f"\n[down mid-run] defer: {counts} ({down_runs} ran before the stop), "
        f"max grants/window {budget(runs)} (data lost with the server: up to 2x across it); "
        f"allow: {len(allow)} ran; raise: {len(failed(fleet, fail))} failed"
    )
    assert grants


def test_a_hung_redis_costs_each_task_a_bounded_time(
    fleet: Fleet, limiter_redis: RedisServer
) -> None:
    limiter = limiter_redis
    assert limiter.proc is not None
    pid = limiter.proc.pid
    warnings_before = len(fleet.grep("Redis unavailable"))
    failed_before = len(fleet.grep("raised unexpected"))
    os.kill(pid, signal.SIGSTOP)
    try:
        sent_at = time.time()
        allow = send(fleet, "allow", 2, 200)
        fail = send(fleet, "raise", 2, 200)
        defer = send(fleet, "defer", 2, 200)
        allowed_ran_and_raised_failed(fleet, allow, fail, 2 * HUNG_BOUND)
        allow_delay = max(r["local"] for r in fleet.runs() if r["id"] in allow) - sent_at
        hung_for = time.time() - sent_at
    finally:
        os.kill(pid, signal.SIGCONT)
    assert allow_delay < HUNG_BOUND + 5, allow_delay
    _runs, counts = ran_once(fleet, defer, 20)
    print(
        f"\n[hung Redis, SIGSTOP] allow tasks ran {allow_delay:.2f}s after sending "
        f"(bound {HUNG_BOUND}s); raise: {len(fail)} failed; defer: {counts} after SIGCONT "
        f"({hung_for:.1f}s stopped); new warnings "
        f"{len(fleet.grep('Redis unavailable')) - warnings_before}, new failures "
        f"{len(fleet.grep('raised unexpected')) - failed_before}"
    )


def test_restart_and_script_flush_mid_stream_lose_nothing(
    fleet: Fleet, limiter_redis: RedisServer
) -> None:
    limiter = limiter_redis
    failures_before = len(fleet.grep("raised unexpected"))
    ids = send(fleet, "defer", 40, 300)
    time.sleep(1.0)
    limiter.client().script_flush()
    time.sleep(1.0)
    limiter.stop()  # a restart: no grant is made between these two lines
    restarted = time.time()
    limiter.start()
    runs, counts = ran_once(fleet, ids, 30)
    assert len(fleet.grep("raised unexpected")) == failures_before
    restart_us = int(restarted * 1_000_000)
    before = [r for r in runs if r["granted"] < restart_us]
    after = [r for r in runs if r["granted"] >= restart_us]
    assert budget(before) <= LIMIT
    assert budget(after) <= LIMIT
    print(
        f"\n[SCRIPT FLUSH + restart] {counts}; max grants/window before the restart "
        f"{budget(before)}, after {budget(after)}, across it {budget(runs)} (the budget "
        f"restarts empty); Redis-error deferrals so far {len(fleet.grep('; Redis error:'))}"
    )


def test_a_listener_that_never_answers_fails_the_decision_in_bounded_time() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)  # the kernel completes connections; nothing ever answers
        port = sock.getsockname()[1]
        limiter = Limiter.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(LimiterUnavailable):
            limiter.acquire("k", "10/s")
        elapsed = time.monotonic() - started
    # one attempt and one retry, each bounded by the socket timeout
    assert elapsed < 3, elapsed
    print(f"\n[listener that never answers] LimiterUnavailable after {elapsed:.2f}s")


def test_a_reserved_copy_deferred_on_a_redis_error_keeps_its_slot() -> None:
    """A deferred copy that finds the limiter's Redis down is published again with the
    token it came with: its reserved slot (and its place in a concurrency line) stay its
    own. The task's own ``before_start`` on a pushed request, a real broker and Redis."""
    from celery import Celery
    from celery.exceptions import Retry
    from kombu.utils.json import loads

    from celery_ratelimit import Concurrency, Limit, RateLimitedTask
    from celery_ratelimit._celery.check import RETRIES_HEADER, TOKEN_HEADER

    broker, redis_down = RedisServer(), RedisServer()
    app = Celery("keeps-slot", broker=broker.url, set_as_current=False)
    app.conf.update(ratelimit_redis_url=redis_down.url, ratelimit_redis_error_countdown=0.5)

    @app.task(
        base=RateLimitedTask,
        ratelimit=[Limit("1/s", key="k"), Concurrency(1, key="k")],
        bind=True,
        shared=False,
    )
    def job(self: Any) -> None:
        return None

    task = app.tasks[job.name]

    def run(headers: dict[str, Any]) -> dict[str, Any] | None:
        """before_start on a pushed request; the copy it published, if any."""
        task.push_request(
            id="job-1",
            is_eager=False,
            called_directly=False,
            args=(),
            kwargs={},
            delivery_info={},
            retries=0,
            **headers,
        )
        try:
            task.before_start("job-1", (), {})
            return None
        except Retry:
            raw = broker.client().rpop("celery")
            assert raw is not None
            return dict(loads(raw)["headers"])
        finally:
            task.pop_request()

    try:
        assert run({}) is None  # allowed: holds the slot and the second's budget
        copy = run({})
        assert copy is not None and copy.get(TOKEN_HEADER)  # denied: deferred, reserved
        token = copy[TOKEN_HEADER]
        redis_down.stop()
        again = run({TOKEN_HEADER: token, RETRIES_HEADER: copy.get(RETRIES_HEADER, 0)})
        assert again is not None and again[TOKEN_HEADER] == token
    finally:
        broker.close()
        redis_down.close()
