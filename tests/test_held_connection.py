"""The limiter's own connection (``_client.HeldConnection``): one per process, shared by
no two callers at once, never inherited across a fork. Real redis-server throughout."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from typing import Any

import pytest
import redis

from celery_ratelimit import Limit, Limiter
from celery_ratelimit._engine.client import HeldConnection
from tests.redis_server import RedisServer


def test_decisions_use_one_connection_that_the_pool_does_not_hand_out(redis_url: str) -> None:
    limiter = Limiter.from_url(redis_url, prefix=f"held-{uuid.uuid4().hex[:8]}")
    pool = limiter.client.connection_pool
    for _ in range(20):
        assert limiter.acquire("k", "1000/s").allowed
    assert len(pool._in_use_connections) == 1
    held = next(iter(pool._in_use_connections))
    limiter.client.ping()  # the client's own commands get another connection
    assert held in pool._in_use_connections
    assert len(pool._available_connections) == 1
    limiter.client.close()


def test_threads_sharing_a_limiter_count_every_call_exactly_once(redis_url: str) -> None:
    limiter = Limiter.from_url(redis_url, prefix=f"held-{uuid.uuid4().hex[:8]}")
    limit = Limit("300/1m")
    allowed: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def hammer() -> None:
        start.wait()
        try:
            allowed.append(sum(limiter.acquire("shared", limit).allowed for _ in range(100)))
        except BaseException as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(allowed) == 300  # 800 calls, exactly the limit granted
    assert limiter.peek("shared", limit).remaining == 0
    limiter.client.close()


def _decide_in_child(limiter: Limiter, key: str, calls: int, out: Any) -> None:
    try:
        out.put(sum(limiter.acquire(key, "100000/1m").allowed for _ in range(calls)))
    except BaseException as exc:
        out.put(repr(exc))


def test_a_forked_child_opens_its_own_connection(redis_url: str) -> None:
    limiter = Limiter.from_url(redis_url, prefix=f"held-{uuid.uuid4().hex[:8]}")
    assert limiter.acquire("k", "100000/1m").allowed  # the parent now holds one
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    children = [
        ctx.Process(target=_decide_in_child, args=(limiter, "k", 300, out)) for _ in range(2)
    ]
    for child in children:
        child.start()
    # the parent decides at the same time: a socket shared with a child would mix replies
    parent = sum(limiter.acquire("k", "100000/1m").allowed for _ in range(300))
    results = [out.get(timeout=30) for _ in children]
    for child in children:
        child.join(10)
    assert results == [300, 300]
    assert parent == 300
    assert limiter.peek("k", "100000/1m").remaining == 100000 - 901
    limiter.client.close()


@pytest.mark.parametrize("kind", ["blocking pool", "single connection"])
def test_clients_whose_connections_are_scarce_are_used_as_they_are(
    redis_url: str, kind: str
) -> None:
    if kind == "blocking pool":
        client = redis.Redis(
            connection_pool=redis.BlockingConnectionPool.from_url(redis_url, max_connections=1)
        )
    else:
        client = redis.Redis.from_url(redis_url, single_connection_client=True)
    assert HeldConnection.for_client(client) is None
    limiter = Limiter(client, prefix=f"held-{uuid.uuid4().hex[:8]}")
    assert [limiter.acquire("k", "2/1m").allowed for _ in range(3)] == [True, True, False]
    client.ping()  # the one connection is still the client's to use
    client.close()


def test_a_restarted_redis_is_reconnected_to_by_the_retry() -> None:
    server = RedisServer()
    try:
        limiter = Limiter.from_url(server.url, prefix="held")
        assert limiter.acquire("k", "10/1m").allowed
        server.restart()
        decision = limiter.acquire("k", "10/1m")  # the held socket was closed: one retry
        assert decision.allowed and decision.remaining == 9  # the budget restarted empty
        limiter.client.close()
    finally:
        server.close()


class _Interrupted(BaseException):
    """What a soft time limit or a signal handler raises in the middle of a call."""


def test_a_call_interrupted_before_its_reply_leaves_nothing_for_the_next(
    redis_url: str,
) -> None:
    limiter = Limiter.from_url(redis_url, prefix=f"held-{uuid.uuid4().hex[:8]}")
    assert limiter.acquire("k", "3/1m").remaining == 2
    held = getattr(limiter._send, "__self__", None)
    assert isinstance(held, HeldConnection) and held._conn is not None
    conn = held._conn

    def interrupted(*_: Any, **__: Any) -> None:
        del conn.read_response  # once: the instance attribute hides the method
        raise _Interrupted

    conn.read_response = interrupted
    with pytest.raises(_Interrupted):
        limiter.acquire("k", "3/1m")  # sent and counted; its reply never read
    # the reply of the interrupted call must not be taken for the next one's
    assert limiter.acquire("k", "3/1m").remaining == 0
    assert not limiter.acquire("k", "3/1m").allowed
    limiter.client.close()


def _pool_for(kind: str, redis_url: str) -> redis.ConnectionPool:
    from redis._parsers import _RESP2Parser
    from redis.connection import Encoder, PythonRespSerializer

    options: dict[str, Any] = {
        "hiredis": {},
        "python parser": {"parser_class": _RESP2Parser},
        "python packer": {
            "command_packer": PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        },
        "RESP3": {"protocol": 3},
        "health checks": {"health_check_interval": 30},
    }[kind]
    return redis.ConnectionPool.from_url(redis_url, **options)


@pytest.mark.parametrize(
    "kind", ["hiredis", "python parser", "python packer", "RESP3", "health checks"]
)
def test_every_connection_kind_decides_the_same(redis_url: str, kind: str) -> None:
    """The held connection decides the same on every kind of connection (either packer,
    either parser, either protocol, health checks): NOSCRIPT recovered, a script error
    raised as one, the connection still in step after it."""
    client = redis.Redis(connection_pool=_pool_for(kind, redis_url))
    limiter = Limiter(client, prefix=f"held-{uuid.uuid4().hex[:8]}")
    decisions = [limiter.acquire("k", Limit("2/1m"), reserve=True) for _ in range(3)]
    assert [(d.allowed, d.remaining, d.reserved) for d in decisions] == [
        (True, 1, False),
        (True, 0, False),
        (False, 0, True),
    ]
    assert 59.0 < decisions[2].retry_after <= 60.0
    client.script_flush()  # the next call meets NOSCRIPT, loads the script and decides
    assert not limiter.acquire("k", "2/1m").allowed
    held = getattr(limiter._send, "__self__", None)
    assert isinstance(held, HeldConnection)
    with pytest.raises(redis.ResponseError, match="unknown command"):
        held.call("NO-SUCH-COMMAND")
    assert held.call("PING") in (b"PONG", "PONG", True)  # the connection is still in step
    assert limiter.peek("k", "2/1m").remaining == 0
    client.close()
