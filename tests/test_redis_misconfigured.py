"""A limiter Redis that refuses the limiter for good ends tasks, clearly, at once.

One real worker node (prefork -c 2, default settings: ``ratelimit_on_redis_error``
is "defer") per case, its limiter URL broken in one way; the broker is a private
redis-server that works. Each task must end FAILURE within seconds with
``LimiterMisconfigured`` naming the cause, and the node must say so in one log line at
ERROR, not one per task.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ratelimit import (
    AsyncLimiter,
    Limit,
    Limiter,
    LimiterMisconfigured,
    LimiterUnavailable,
)
from celery_ratelimit._engine.failures import version_error
from tests.fault_nodes import Fleet
from tests.nodes import rabbitmq_reachable, unique_prefix
from tests.redis_server import RedisServer, free_port, tls_redis

pytestmark = [pytest.mark.celery, pytest.mark.timeout(240)]

#: A task failed by a permanent error ends within this many seconds of being sent.
FAILS_WITHIN = 10.0


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    server = RedisServer()
    admin = server.client()
    admin.acl_setuser(
        "noeval",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        commands=["+@all", "-evalsha", "-eval"],
    )
    admin.acl_setuser(
        "nokeys", enabled=True, passwords=["+pw"], keys=["elsewhere:*"], commands=["+@all"]
    )
    admin.set("crl-wrongtype:{shared}:log:1000000", "not a sorted set")
    admin.close()
    yield server
    server.close()


def _url(server: RedisServer, userinfo: str = "") -> str:
    return f"redis://{userinfo}127.0.0.1:{server.port}/0"


CASES = {
    "ACL user without EVALSHA": (
        lambda s: _url(s, "noeval:pw@"),
        r"lacks a permission .*evalsha.*ACL SETUSER noeval",
    ),
    "ACL user without key access": (
        lambda s: _url(s, "nokeys:pw@"),
        r"lacks a permission .*access (a key|one of the keys).*ACL SETUSER nokeys",
    ),
    "wrong password": (
        lambda s: _url(s, "noeval:wrong@"),
        r"refused the limiter's credentials.*check the user and password",
    ),
    "password missing": (
        lambda s: _url(s, "noeval@"),
        r"refused the limiter's credentials",
    ),
    "an untrusted certificate": (
        lambda s: "",  # a TLS server of its own, below
        r"(?i)certificate verify failed.*ssl_ca_certs",
    ),
    "a key of another type": (
        lambda s: _url(s),
        r"holds a value of another type.*ratelimit_key_prefix",
    ),
    "a Cluster URL naming a server not in cluster mode": (
        lambda s: f"redis+cluster://127.0.0.1:{s.port}",
        r"not in cluster mode.*use redis://host:port/db for a single server",
    ),
    "not a Redis server (RabbitMQ's port)": (
        lambda s: "redis://127.0.0.1:5672/0",
        r"does not point at a Redis server",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_misconfigured_limiter_fails_tasks_at_once_with_one_clear_log_line(
    server: RedisServer, tmp_path: Path, request: pytest.FixtureRequest, case: str
) -> None:
    make_url, cause = CASES[case]
    if "RabbitMQ" in case and not rabbitmq_reachable():
        pytest.skip("nothing listens on 127.0.0.1:5672")
    if case == "password missing":
        # a server that requires a password of the default user
        locked = RedisServer()
        request.addfinalizer(locked.close)
        locked.client().config_set("requirepass", "s3cret")
        limiter_url = f"redis://127.0.0.1:{locked.port}/0"
    elif case == "an untrusted certificate":
        # a TLS server whose CA the limiter's URL does not name (no ssl_ca_certs)
        (tmp_path / "tls").mkdir()
        stack = contextlib.ExitStack()
        request.addfinalizer(stack.close)
        port, _ca = stack.enter_context(tls_redis(tmp_path / "tls"))
        limiter_url = f"rediss://127.0.0.1:{port}/0"
    else:
        limiter_url = make_url(server)
    fleet = Fleet(
        tmp_path,
        broker_url=f"redis://127.0.0.1:{server.port}/1",
        limiter_url=limiter_url,
        runs_url=f"redis://127.0.0.1:{server.port}/3",
        prefix="crl-wrongtype" if "another type" in case else unique_prefix("misconfigured"),
    )
    try:
        fleet.add(1)
        sent = time.monotonic()
        ids = [fleet.send("limited", i) for i in range(6)]
        deadline = sent + FAILS_WITHIN
        failures: list[str] = []
        while time.monotonic() < deadline:
            failures = [
                line
                for line in fleet.grep("raised unexpected")
                if "LimiterMisconfigured" in line and any(i in line for i in ids)
            ]
            if len(failures) == len(ids):
                break
            time.sleep(0.2)
        took = time.monotonic() - sent
        assert len(failures) == len(ids), f"{len(failures)} of {len(ids)} failed in {took:.1f}s"
        assert fleet.runs() == []  # no body ran
        assert not fleet.grep("ratelimit: deferred")  # none was deferred first
        reports = [
            line for line in fleet.grep("ratelimit: ") if "fails until this is fixed" in line
        ]
        # one line per pool process that met it (concurrency 2), not one per task
        assert 1 <= len(reports) <= 2 < len(ids), reports
        assert all("ERROR" in line for line in reports)
        assert re.search(cause, reports[0]), reports[0]
        assert limiter_url not in fleet.logs(tail=10**6)  # nor its password
        print(f"\n[{case}] {len(ids)} tasks failed within {took:.1f}s: {reports[0]}")
    except BaseException:
        print(fleet.logs())
        raise
    finally:
        fleet.stop()


@pytest.mark.parametrize("form", ["redis", "rediss", "redis+cluster", "redis+sentinel"])
def test_a_closed_port_is_named_at_start_and_deferrals_warned_once_per_interval(
    server: RedisServer, tmp_path: Path, form: str
) -> None:
    port = free_port()
    closed = {
        "redis": f"redis://:hunter2@127.0.0.1:{port}/0",
        "rediss": f"rediss://:hunter2@127.0.0.1:{port}/0",
        # the README's forms, every node closed: a Cluster client asks for the slot map
        # at its first command, a Sentinel client for the primary
        "redis+cluster": f"redis+cluster://127.0.0.1:{port},127.0.0.1:{free_port()}",
        "redis+sentinel": f"redis+sentinel://127.0.0.1:{port},127.0.0.1:{free_port()}/m/0",
    }
    fleet = Fleet(
        tmp_path,
        broker_url=f"redis://127.0.0.1:{server.port}/1",
        limiter_url=closed[form],
        runs_url=f"redis://127.0.0.1:{server.port}/3",
        prefix=unique_prefix("closed-port"),
        settings={"error_countdown": "0.3"},
    )
    try:
        fleet.add(1)
        ids = [fleet.send("limited", i) for i in range(4)]
        if form in ("redis", "rediss"):
            # a URL that never answered is most likely wrong: the node says so at
            # ERROR, naming the setting and the URL (not its password), before the
            # tasks' warnings
            deadline = time.monotonic() + FAILS_WITHIN
            while not fleet.grep("nothing answered") and time.monotonic() < deadline:
                time.sleep(0.2)
            errors = fleet.grep("nothing answered")
            assert len(errors) == 1, errors
            assert "ERROR" in errors[0] and "ratelimit_redis_url" in errors[0]
            assert f"'{form}://:***@127.0.0.1:{port}/0'" in errors[0]
            assert "Connection refused" in errors[0]
        # each task is deferred again and again (how often in a given time depends on
        # the machine's load: wait until every one was deferred twice)...
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            deferred = fleet.grep("Redis error:")
            if all(sum(i in line for line in deferred) >= 2 for i in ids):
                break
            time.sleep(0.2)
        assert all(sum(i in line for line in deferred) >= 2 for i in ids)
        # "the limiter's first call" is said by a process's first failure only (the
        # node's check at start, or its first decision), not by each deferral after it
        firsts = [line for line in deferred if "the limiter's first call" in line]
        assert len(firsts) <= 2 < len(deferred), firsts  # two pool processes
        warnings = [line for line in fleet.grep("Redis unavailable") if "deferring" in line]
        assert 1 <= len(warnings) <= 2  # ...and that was said once per pool process
        said = "No master found" if form == "redis+sentinel" else "Connection refused"
        assert all("WARNING" in line and said in line for line in warnings), warnings
        assert not fleet.grep("raised unexpected")  # transient: nothing failed
        assert "hunter2" not in fleet.logs(tail=10**6)
    except BaseException:
        print(fleet.logs())
        raise
    finally:
        fleet.stop()


def test_only_the_first_failure_of_a_limiter_says_it_was_its_first_call() -> None:
    limiter = Limiter.from_url(f"redis://127.0.0.1:{free_port()}/0")
    said = []
    for _ in range(3):
        with pytest.raises(LimiterUnavailable) as raised:
            limiter.acquire("k", "10/s")
        said.append(str(raised.value))
    assert "during the limiter's first call" in said[0]
    for later in said[1:]:
        assert "first call" not in later and "during a rate-limit decision" in later, later
    limiter.client.close()


def test_only_the_first_failure_of_an_async_limiter_says_it_was_its_first_call() -> None:
    async def failures() -> list[str]:
        limiter = AsyncLimiter.from_url(f"redis://127.0.0.1:{free_port()}/0")
        said = []
        for _ in range(3):
            try:
                await limiter.acquire("k", "10/s")
            except LimiterUnavailable as exc:
                said.append(str(exc))
        await limiter.aclose()
        return said

    first, *later = asyncio.run(failures())
    assert "during the limiter's first call" in first
    assert later and all("first call" not in one for one in later), later


def test_a_server_without_zmscore_is_told_to_upgrade() -> None:
    """What Redis 6.0 answers (no ZMSCORE), from a 7.x server with the command renamed
    away: LimiterMisconfigured naming the version needed, not a deferral forever."""
    server = RedisServer("--rename-command", "ZMSCORE", '""')
    try:
        limiter = Limiter.from_url(server.url)
        with pytest.raises(LimiterMisconfigured, match=r"lacks a command .* Redis 6\.2 or newer"):
            limiter.acquire("k", "10/s")
        limiter.client.close()
    finally:
        server.close()


@pytest.mark.parametrize(
    ("version", "too_old"),
    [("6.0.20", True), ("5.0.14", True), ("6.2.0", False), ("7.0.15", False), ("8.2.1", False)],
)
def test_the_version_check_reads_info_as_redis_writes_it(version: str, too_old: bool) -> None:
    error = version_error(version)
    assert (error is not None) == too_old
    if error is not None:
        assert version in str(error) and "6.2 or newer" in str(error)


def test_a_busy_server_and_a_read_only_replica_are_unavailable_for_now_not_misconfigured() -> None:
    """The README's "Redis unreachable for now": a server running another client's long
    script answers ``BUSY``, a primary turned replica (a failover) answers ``READONLY``
    to the script's writes. Both are ``LimiterUnavailable`` (``ratelimit_on_redis_error``
    decides), never ``LimiterMisconfigured``, for ``Limiter`` and ``AsyncLimiter``; the
    limiter decides again once the server is back."""
    limit = Limit("5/s")
    with RedisServer("--lua-time-limit", "100") as server, RedisServer() as primary:
        limiter = Limiter.from_url(server.url, prefix="transient")
        assert limiter.acquire("k", limit).allowed

        def runs_forever() -> None:
            with server.client() as client, contextlib.suppress(redis.ResponseError):
                client.eval("local i = 0 while true do i = i + 1 end", 0)

        busy = threading.Thread(target=runs_forever)
        busy.start()
        try:
            time.sleep(0.3)  # past the busy-reply threshold
            with pytest.raises(LimiterUnavailable, match="BUSY"):
                limiter.acquire("k", limit)
            with pytest.raises(LimiterUnavailable, match="BUSY"):
                asyncio.run(_acquire_async(server.url, limit))
        finally:
            with server.client() as client:
                client.script_kill()
            busy.join()
        assert limiter.acquire("k", limit).allowed

        with server.client() as client:
            client.replicaof("127.0.0.1", primary.port)
            deadline = time.monotonic() + 10
            while client.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica did not sync"
                time.sleep(0.1)
        with pytest.raises(LimiterUnavailable, match="read only replica"):
            limiter.acquire("k", limit)
        with pytest.raises(LimiterUnavailable, match="read only replica"):
            asyncio.run(_acquire_async(server.url, limit))
        with server.client() as client:
            client.replicaof("NO", "ONE")  # promoted: a failover's end
        assert limiter.acquire("k", limit).allowed
        limiter.client.close()


async def _acquire_async(url: str, limit: Limit) -> Any:
    limiter = AsyncLimiter.from_url(url, prefix="transient")
    try:
        return await limiter.acquire("k", limit)
    finally:
        await limiter.aclose()


def test_a_server_loading_its_data_is_unavailable_for_now_not_misconfigured() -> None:
    """The README's ``LOADING``: a restarted server answers every command with it until
    its dataset is loaded. ``Limiter`` and ``AsyncLimiter`` raise ``LimiterUnavailable``
    then (``ratelimit_on_redis_error`` decides), never ``LimiterMisconfigured``, and
    decide again once it has loaded. The load is slowed per key (``key-load-delay``);
    Redis 7 and Valkey answer between keys when told to, 6.2 only every 2 MB of the
    file: there the dataset is 20 MB of values that do not compress."""
    limit = Limit("100000/s")
    with RedisServer("--key-load-delay", "100") as server:
        client = server.client()
        keys = 20_000
        with contextlib.suppress(redis.ResponseError):  # 7.0 and later
            client.config_set("loading-process-events-interval-bytes", 1024)
            server.extra = (*server.extra, "--loading-process-events-interval-bytes", "1024")
            keys = 8_000
        pipe = client.pipeline(transaction=False)
        for i in range(keys):
            pipe.set(f"fill:{i}", os.urandom(1000))
        pipe.execute()
        client.save()
        limiter = Limiter.from_url(server.url, prefix="loading")
        assert limiter.acquire("k", limit).allowed
        server.stop()
        starting = threading.Thread(target=server.start)  # returns once it has loaded
        starting.start()
        seen: dict[str, set[str]] = {"sync": set(), "async": set()}
        try:
            deadline = time.monotonic() + 30
            while starting.is_alive():
                assert time.monotonic() < deadline, seen
                for kind in ("sync", "async"):
                    try:
                        if kind == "sync":
                            limiter.acquire("k", limit)
                        else:
                            asyncio.run(_acquire_async(server.url, limit))
                    except LimiterUnavailable as exc:  # LimiterMisconfigured fails the test
                        if "loading" in str(exc):
                            seen[kind].add("loading")
                time.sleep(0.02)
        finally:
            starting.join()
        if "--loading-process-events-interval-bytes" in server.extra:
            assert seen == {"sync": {"loading"}, "async": {"loading"}}, seen
        else:  # 6.2 answers a few times a load: one of the two calls sees it
            assert {"loading"} in seen.values(), seen
        assert limiter.acquire("k", limit).allowed
        limiter.client.close()
