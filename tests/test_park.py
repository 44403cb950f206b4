"""The park (``_park``): deferred copies wait in a real redis-server and are published
to a real Redis broker by the mover, at least once.

The mover's steps are driven one at a time here (``move_once``); the worker-node tests
(``test_celery_nodes``) run it inside real nodes.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ratelimit import Concurrency, InvalidLimit, Limit, RateLimitedTask, install
from celery_ratelimit._celery import park as _park
from celery_ratelimit._celery.park import move_once, park, park_calls, park_keys
from celery_ratelimit._celery.settings import limiter_for, park_after, park_undecided
from celery_ratelimit._tools.embedded import RedisServer

BROKER_DB = 5


@pytest.fixture
def app(redis_url: str, request: pytest.FixtureRequest) -> Iterator[Celery]:
    """An app on the private redis-server: broker in db 5, limiter keys under a prefix
    of the test's own."""
    prefix = "park-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    broker = redis_url.rsplit("/", 1)[0] + f"/{BROKER_DB}"
    app = Celery("parktest", broker=broker, set_as_current=False)
    app.conf.update(ratelimit_redis_url=redis_url, ratelimit_key_prefix=prefix)

    @app.task(base=RateLimitedTask, ratelimit=Limit("1/s"), name=f"{prefix}.fetch")
    def fetch(x: int, *, region: str) -> int:
        return x

    app.conf.fetch_name = fetch.name

    with redis.Redis.from_url(broker) as client:
        client.flushdb()  # the test's own database
    yield app
    limiter = limiter_for(app)
    for key in limiter.client.scan_iter(f"{prefix}:*"):
        limiter.client.delete(key)


def deferred_copy(app: Celery, task_id: str, task: Any = None) -> Any:
    """A deferred copy as ``Check.copy`` makes it: the same task, its headers, an ETA."""
    task = task or app.tasks[app.conf.fetch_name]
    return task.signature(
        (7,),
        {"region": "eu"},
        task_id=task_id,
        headers={"ratelimit_deferrals": 1, "ratelimit_token": "00ff"},
        eta=datetime.datetime.now(datetime.timezone.utc),
    )


def queued(app: Celery) -> list[dict[str, Any]]:
    """The messages in the broker's default queue, oldest first."""
    with redis.Redis.from_url(app.conf.broker_url) as client:
        return [json.loads(raw) for raw in reversed(client.lrange("celery", 0, -1))]


def waiting(app: Celery) -> int:
    limiter = limiter_for(app)
    return int(limiter.client.zcard(park_keys(app, limiter)[0]))


def test_a_parked_copy_is_published_a_lead_before_it_is_due_with_its_eta_in_redis_time(
    app: Celery,
) -> None:
    task = app.tasks[app.conf.fetch_name]
    limiter = limiter_for(app)
    move_once(app)  # a mover serves the park
    seconds, micros = limiter.client.time()
    # due in 3 s: the "not yet" below holds unless this process stalls for 2 s
    assert park(task, deferred_copy(app, "t-1"), 3.0)
    due = seconds + micros / 1e6 + 3.0
    after_s, after_us = limiter.client.time()
    latest = after_s + after_us / 1e6 + 3.0
    assert waiting(app) == 1
    assert move_once(app) <= _park.POLL
    assert queued(app) == []  # due in 3 s: not yet
    time.sleep(max(latest - _park.LEAD - time.time(), 0) + 0.05)
    move_once(app)
    messages = queued(app)
    assert len(messages) == 1
    headers = messages[0]["headers"]
    assert headers["id"] == "t-1"
    assert headers["task"] == app.conf.fetch_name
    assert headers["ratelimit_deferrals"] == 1 and headers["ratelimit_token"] == "00ff"
    eta = datetime.datetime.fromisoformat(headers["eta"]).timestamp()
    # the slot's instant (Redis TIME when parked, plus 3 s), not the publish time
    assert due - 0.001 <= eta <= latest + 0.001
    args, kwargs, _ = json.loads(base64.b64decode(messages[0]["body"]))
    assert (args, kwargs) == ([7], {"region": "eu"})
    assert waiting(app) == 0
    counts = limiter.client.hgetall(park_keys(app, limiter)[2])
    assert int(counts[b"park"]) == 1 and int(counts[b"published"]) == 1
    assert park_calls(limiter.client, limiter.prefix) >= 3  # park, claims, drop


def test_a_copy_is_counted_published_only_at_its_drop_after_the_broker_has_it(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race behind the node test's "published == parked" read right after the last
    task ran (failed 1 in 2 on shared nodes): a mover publishes a copy, then drops it,
    and the drop is what counts it published. While the copy is in the broker (a worker
    may already be running it), the counts still show it parked and waiting; once the
    mover's look is over they show it published. A reader must wait for the drop."""
    task = app.tasks[app.conf.fetch_name]
    limiter = limiter_for(app)
    counts_key = park_keys(app, limiter)[2]
    move_once(app)
    assert park(task, deferred_copy(app, "t-race"), 0.0)
    seen: list[tuple[int, int]] = []
    publish = _park._publish

    def publish_and_look(*args: Any) -> None:
        publish(*args)  # the copy is in the broker: a worker could run it now
        counts = limiter.client.hgetall(counts_key)
        seen.append((int(counts.get(b"published", 0)), waiting(app)))

    monkeypatch.setattr(_park, "_publish", publish_and_look)
    move_once(app)
    assert len(queued(app)) == 1
    assert seen == [(0, 1)]  # published to the broker, not yet counted
    counts = limiter.client.hgetall(counts_key)
    assert int(counts[b"published"]) == int(counts[b"park"]) == 1 and waiting(app) == 0


@pytest.mark.parametrize("failure", [ConnectionError("broker down"), SystemExit(1)])
def test_a_copy_its_mover_did_not_publish_is_claimed_again_when_the_claim_lapses(
    app: Celery, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    """A publish that failed (the copy stays claimed) and a mover that died between its
    claim and its publish (``SystemExit`` out of ``move_once``) lose no copy."""
    # a lease of 3 s: the claim holds off other movers for 2 s (it lapses a lead early)
    monkeypatch.setattr(_park, "LEASE", 3.0)
    move_once(app)
    assert park(app.tasks[app.conf.fetch_name], deferred_copy(app, "t-2"), 1.6)
    time.sleep(0.7)  # due within the lead

    def fail(*_: Any) -> None:
        raise failure

    with monkeypatch.context() as patched:
        patched.setattr(_park, "_publish", fail)
        with pytest.raises(SystemExit) if isinstance(failure, SystemExit) else nullcontext():
            move_once(app)
    assert queued(app) == [] and waiting(app) == 1
    move_once(app)  # claimed by the first mover until its claim lapses
    assert queued(app) == []
    time.sleep(_park.LEASE - _park.LEAD + 0.1)
    move_once(app)
    assert [m["headers"]["id"] for m in queued(app)] == ["t-2"]
    assert waiting(app) == 0


def test_a_claim_whose_reply_was_lost_is_taken_back_by_its_mover_at_its_next_look(
    app: Celery,
) -> None:
    """A claim that timed out may still have run once Redis went on (a paused server):
    its mover takes its copies back at the next claim, not after the lease."""
    mover = _park.Claims()
    move_once(app, mover)
    assert park(app.tasks[app.conf.fetch_name], deferred_copy(app, "t-lost"), 1.6)
    time.sleep(0.7)  # due within the lead
    limiter = limiter_for(app)
    keys = park_keys(app, limiter)
    # the claim ran, and its reply never reached the mover
    arguments = ["claim", int(_park.LEAD * 1e6), int(_park.LEASE * 1e6), 10, mover.mover, "0"]
    assert len(limiter.run_script("park", keys, arguments)) == 4
    assert waiting(app) == 1 and queued(app) == []
    move_once(app)  # another mover: the copy is claimed, not its to take
    assert queued(app) == []
    mover.lost = True  # what the timeout left it knowing
    move_once(app, mover)
    assert [m["headers"]["id"] for m in queued(app)] == ["t-lost"]
    assert waiting(app) == 0 and not limiter.client.hlen(keys[3])


def test_a_mover_whose_broker_is_down_keeps_every_copy_and_logs_once(
    redis_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker unreachable (a real server, stopped): the mover gives up a claim at its
    first copy (the others would fail alike, each after the publish retries), keeps every
    copy parked, logs one WARNING per interval rather than a line per copy, and publishes
    them all once the broker is back and the claim has lapsed."""
    monkeypatch.setattr(_park, "LEASE", 3.0)
    with RedisServer() as broker:
        app = Celery("parkdown", broker=broker.url, set_as_current=False)
        app.conf.update(ratelimit_redis_url=redis_url, ratelimit_key_prefix="park-down")

        @app.task(base=RateLimitedTask, ratelimit=Limit("1/s"), name="park-down.fetch")
        def fetch(x: int, *, region: str) -> int:
            return x

        limiter = limiter_for(app)
        move_once(app)  # a mover serves the park
        for n in range(5):
            assert park(fetch, deferred_copy(app, f"t-down-{n}", fetch), 1.2)
        broker.stop()
        mover = _park.Mover(app)
        with caplog.at_level(logging.WARNING, logger="celery_ratelimit"):
            mover.start()
            deadline = time.monotonic() + 60
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.1)  # the claim of all five fails
            time.sleep(_park.LEASE)  # ... and, its claim lapsed, again
            mover.stop()
            mover.join(timeout=30)
        lines = [r for r in caplog.records if r.name == "celery_ratelimit"]
        assert [r.levelname for r in lines] == ["WARNING"]
        assert "could not publish parked tasks" in lines[0].getMessage()
        assert limiter.client.zcard(park_keys(app, limiter)[0]) == 5
        broker.start()
        time.sleep(_park.LEASE)  # the failed claim lapses
        try:
            move_once(app)
            with broker.client() as client:
                ids = sorted(json.loads(m)["headers"]["id"] for m in client.lrange("celery", 0, -1))
            assert ids == [f"t-down-{n}" for n in range(5)]
            assert limiter.client.zcard(park_keys(app, limiter)[0]) == 0
        finally:
            for key in limiter.client.scan_iter("park-down:*"):
                limiter.client.delete(key)


def test_a_park_no_mover_serves_takes_no_copy(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """No mover claimed lately (no node runs one: an in-process test worker, or every
    node down): the copy is not parked, so the caller publishes it to the broker."""
    task = app.tasks[app.conf.fetch_name]
    assert not park(task, deferred_copy(app, "t-3"), 3.0)
    assert waiting(app) == 0
    move_once(app)
    assert park(task, deferred_copy(app, "t-3"), 3.0)
    monkeypatch.setattr(_park, "MOVER_SEEN", 0.2)
    time.sleep(0.3)
    assert not park(task, deferred_copy(app, "t-4"), 3.0)
    assert waiting(app) == 1


def test_parks_of_two_brokers_are_apart(app: Celery, redis_url: str) -> None:
    other = Celery("parktest", broker=redis_url.rsplit("/", 1)[0] + "/6", set_as_current=False)
    other.conf.update(ratelimit_redis_url=redis_url, ratelimit_key_prefix="x")
    limiter = limiter_for(app)
    assert park_keys(app, limiter) != park_keys(other, limiter)
    assert len({k.split("}")[0] for k in park_keys(app, limiter)}) == 1  # one hash tag


@pytest.mark.parametrize(
    ("broker", "limiter", "expected"),
    [
        ("redis://127.0.0.1:6379/1", None, 2.0),  # the limiter defaults to the broker
        ("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6379/0", 2.0),  # same server
        ("redis://h:6379/1", "redis://h/3", 2.0),
        ("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6380/0", None),  # another server
        ("amqp://guest:guest@127.0.0.1:5672//", "redis://127.0.0.1:6379/0", None),
        # the README's Cluster and Sentinel forms: compared node by node
        ("redis://b:7001/1", "redis+cluster://a:7000,b:7001,c:7002", 2.0),
        ("redis://d:7003/1", "redis+cluster://a:7000,b:7001,c:7002", None),
        (
            "sentinel://s:26379;sentinel://t:26379",
            "redis+sentinel://t:26379,u:26379/mymaster/0",
            2.0,
        ),
        ("sentinel://s:26379", "redis+sentinel://s:26379,t:26379/other/0", None),
        ("sentinel://s:26379", "redis+sentinel://u:26379/mymaster/0", None),
        ("redis://s:6379/1", "redis+sentinel://s:26379,t:26379/mymaster/0", None),
    ],
)
def test_auto_parks_only_where_the_broker_keeps_its_own_messages(
    broker: str, limiter: str | None, expected: float | None
) -> None:
    """Under "auto" a copy is parked only in the broker's own Redis server, so that a
    parked copy is as durable as a published one; elsewhere parking is asked for."""
    app = Celery("auto", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = {"master_name": "mymaster"}
    if limiter:
        app.conf.ratelimit_redis_url = limiter
    assert park_after(app) == expected
    app.conf.ratelimit_park_after = 5
    assert park_after(app) == 5.0


@pytest.mark.parametrize(
    ("broker", "limiter", "options"),
    [
        ("redis://d:7003/1", "redis+cluster://a:7000,b:7001", {}),
        ("sentinel://s:26379", "redis+sentinel://s:26379/mymaster/0", {}),  # no master_name
        ("redis://s:6379/1", "redis+sentinel://s:26379,t:26379/mymaster/0", {}),
    ],
)
def test_auto_that_cannot_tell_leaves_parking_off_and_says_how_to_turn_it_on(
    broker: str, limiter: str, options: dict[str, str]
) -> None:
    app = Celery("undecided", broker=broker, set_as_current=False)
    app.conf.update(ratelimit_redis_url=limiter, broker_transport_options=options)
    assert park_after(app) is None
    assert "set ratelimit_park_after = 2 if it is" in (park_undecided(app) or "")
    app.conf.ratelimit_park_after = None
    assert park_undecided(app) is None


@pytest.mark.parametrize("value", [1.0, 0, -3, "2", True, float("inf")])
def test_a_bad_park_after_is_refused_at_install_naming_the_value(value: Any) -> None:
    app = Celery("bad", set_as_current=False)
    app.conf.ratelimit_park_after = value
    with pytest.raises(InvalidLimit, match="ratelimit_park_after must be 'auto', None"):
        install(app)


def test_park_after_none_is_accepted(app: Celery) -> None:
    app.conf.ratelimit_park_after = None
    install(app)


def test_a_parked_waiter_whose_turn_is_handed_over_is_called_in_and_published_due_now(
    app: Celery,
) -> None:
    """A body that ends hands its concurrency slot to the first call in line; that
    call's copy, parked for its *expected* turn far ahead, is made due now and a mover
    woken for it: it is published at once, with an ETA of now, not of the estimate."""
    task = app.tasks[app.conf.fetch_name]
    limiter = limiter_for(app)
    keys, wake = park_keys(app, limiter), park_keys(app, limiter)[5]
    conc = Concurrency(1, key="callin")
    holder = limiter.acquire("callin", conc)
    waiter = limiter.acquire("callin", conc, reserve=True)
    assert holder.allowed and waiter.reserved
    move_once(app)  # a mover serves the park
    # its copy is parked as a call in line is, due (by the estimate) in 60 s
    assert park(task, deferred_copy(app, "t-waiter"), 60.0, waiting=waiter.token)
    assert park(task, deferred_copy(app, "t-other"), 60.0)  # a copy not in line
    move_once(app)
    assert queued(app) == []  # both due in 60 s
    handed = limiter.release_handing(holder.token, "callin", conc)
    assert handed == (waiter.token,)  # the slot went to the first call in line
    seconds, micros = limiter.client.time()
    assert _park.call_in(app, limiter, waiter.token) is True
    assert limiter.client.lrange(wake, 0, -1) == [b"1"]  # a mover is woken
    assert _park.call_in(app, limiter, "00" * 8) is False  # no copy of that call parked
    move_once(app)
    messages = queued(app)
    assert [m["headers"]["id"] for m in messages] == ["t-waiter"]  # the other waits
    eta = datetime.datetime.fromisoformat(messages[0]["headers"]["eta"]).timestamp()
    assert eta <= seconds + micros / 1e6 + 1.0  # due now, not in 60 s
    assert waiting(app) == 1
    assert limiter.client.hgetall(keys[4]) == {}  # dropped: nothing of it left held
    assert _park.call_in(app, limiter, waiter.token) is False  # published: once


def test_a_copy_in_line_is_due_a_turn_slack_late_and_claimed_a_turn_lead_before(
    app: Celery,
) -> None:
    task = app.tasks[app.conf.fetch_name]
    limiter = limiter_for(app)
    keys = park_keys(app, limiter)
    move_once(app)
    assert park(task, deferred_copy(app, "t-plain"), 10.0)
    assert park(task, deferred_copy(app, "t-line"), 10.0, waiting="ab" * 8)
    scores = dict(limiter.client.zrange(keys[0], 0, -1, withscores=True))
    plain, line = (scores[k] for k in sorted(scores, key=lambda k: k.startswith(b"ab")))
    # the copy in line comes by itself TURN_SLACK after its expected turn; a mover
    # claims what is scored within LEAD of now: it TURN_LEAD before it is due, the
    # other LEAD before
    later = _park.TURN_SLACK + _park.LEAD - _park.TURN_LEAD
    assert line - plain == pytest.approx(later * 1e6, abs=50_000)
