"""Concurrency limits and upstream pauses on real worker nodes (``celery worker``
subprocesses sharing a private Redis broker and limiter): never more bodies at once
than the limit, by Redis time, on every pool and through the three forms; a killed
worker's slot comes back after its lease; a 429 pause holds every node off the key."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from celery_ratelimit import Concurrency, Limiter
from tests.measure import most_at_once, server_us
from tests.nodes import Nodes, wait_for_records

pytestmark = [pytest.mark.celery, pytest.mark.timeout(240)]


def bodies(nodes: Nodes, ids: list[str]) -> list[tuple[int, int]]:
    """(start, end) of every body of ``ids`` that noted both, by Redis time (µs)."""
    wanted = set(ids)
    starts: dict[str, list[int]] = {}
    for run in nodes.runs():
        if run["id"] in wanted:
            starts.setdefault(run["id"], []).append(run["t"])
    spans = []
    for end in nodes.ends():
        if end["id"] in wanted and starts.get(end["id"]):
            spans.append((starts[end["id"]].pop(0), end["t"]))
    return spans


def wait_for(nodes: Nodes, ids: list[str], timeout: float) -> None:
    """Until every one of ``ids`` noted its end (then 0.5 s more), or ``timeout``."""
    wait_for_records(nodes.ends, ids, timeout)


def drain_slots(nodes: Nodes, task: str, count: int, timeout: float = 90) -> dict[str, Any]:
    """Send ``count`` tasks holding a slot of Concurrency(2) for 0.3 s each; assert no
    instant had more than 2 bodies and every task ran once; return the figures."""
    ids = [nodes.send(task, i).id for i in range(count)]
    wait_for(nodes, ids, timeout)
    runs = Counter(r["id"] for r in nodes.runs() if r["id"] in set(ids))
    spans = bodies(nodes, ids)
    assert sorted(runs) == sorted(ids), f"{len(runs)} of {count} tasks ran"
    assert set(runs.values()) == {1}, "a task ran twice"
    assert len(spans) == count
    assert most_at_once(spans) <= 2
    first = min(s for s, _ in spans)
    last = max(e for _, e in spans)
    busy = sum(e - s for s, e in spans) / (2 * (last - first))
    print(f"{task}: {count} bodies of 0.3 s, Concurrency(2): utilization {busy:.2f}")
    return {"utilization": busy}


@pytest.mark.parametrize("task", ["slotted", "slotted_by_decorator", "slotted_by_rules"])
def test_three_nodes_never_run_more_bodies_at_once_than_the_limit(
    shared_nodes: Nodes, task: str
) -> None:
    drain_slots(shared_nodes, task, 24)


def still_held(client: Any, prefix: str) -> list[str]:
    """The keys under ``prefix`` still holding something of a call: a concurrency slot
    (its starts), a place in line (its waiters, those that may be handed a turn), a
    parked copy, a mover's claim or a parked copy's place in line."""
    held = []
    for pattern in ("*:conc:0:s", "*:conc:0:r", "*:conc:0:go", "*{park:*}:due"):
        held += [k.decode() for k in client.scan_iter(f"{prefix}:{pattern}") if client.zcard(k)]
    for pattern in ("*{park:*}:claims", "*{park:*}:turns"):
        held += [k.decode() for k in client.scan_iter(f"{prefix}:{pattern}") if client.hlen(k)]
    return held


def test_a_slot_freed_early_calls_in_the_parked_copy_it_was_handed_to(
    shared_nodes: Nodes,
) -> None:
    """Uneven bodies (0.1-1.2 s) sent at once to three nodes: calls in line are parked
    for their expected turn, and a body that ends sooner hands its slot to the first of
    them, whose copy is called in (``park.call_in``) instead of waiting out the
    estimate. Every task runs once, never more than 2 at once by Redis time, and once
    idle nothing is left held: no slot, no place in line, no parked copy."""
    nodes = shared_nodes
    times = [0.1, 1.2, 0.2, 0.9, 0.1, 0.6, 1.1, 0.1, 0.4, 0.8, 0.1, 0.3]
    ids = [nodes.send("slotted_for", i, body).id for i, body in enumerate(times)]
    wait_for(nodes, ids, 90)
    runs = Counter(r["id"] for r in nodes.runs() if r["id"] in set(ids))
    assert sorted(runs) == sorted(ids) and set(runs.values()) == {1}
    assert most_at_once(bodies(nodes, ids)) <= 2
    with nodes.redis() as client:
        counts = [client.hgetall(k) for k in client.scan_iter(f"{nodes.prefix}:{{park:*}}:counts")]
        assert sum(int(c.get(b"call", 0)) for c in counts) >= 1  # copies were called in
        deadline = time.monotonic() + 10
        while (held := still_held(client, nodes.prefix)) and time.monotonic() < deadline:
            time.sleep(0.2)  # the last releases and drops
        assert held == []


@pytest.mark.parametrize(
    ("pool", "concurrency"), [("threads", 4), ("solo", 1), ("gevent", 20), ("eventlet", 20)]
)
def test_every_pool_holds_and_releases_slots(
    start_nodes: Callable[..., Nodes], pool: str, concurrency: int
) -> None:
    nodes = start_nodes(pool=pool, concurrency=concurrency, count=2)
    drain_slots(nodes, "slotted", 12)


def test_every_exit_of_a_body_gives_its_slot_back(shared_nodes: Nodes) -> None:
    """Success, an exception and a self.retry() each end a body: 12 tasks (4 fail, 4
    retry once) all run within Concurrency(2), none waits on a slot never given back."""
    nodes = shared_nodes
    ids = [nodes.send("slotted_failing", i).id for i in range(12)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(nodes.ends()) < 16:
        time.sleep(0.1)
    spans = bodies(nodes, ids)
    assert len(spans) == 16  # 12 first runs, 4 retries
    assert most_at_once(spans) <= 2


def test_a_killed_workers_slot_comes_back_after_its_lease(
    start_nodes: Callable[..., Nodes],
) -> None:
    """Concurrency(1, lease=3): a body's node is SIGKILLed mid-body; another task waits
    while the lease runs, then runs on the surviving node."""
    nodes = start_nodes(count=2)
    client = nodes.redis()
    first = nodes.send("leased", 0, 60).id
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(r["id"] == first for r in nodes.runs()):
        time.sleep(0.05)
    run = next(r for r in nodes.runs() if r["id"] == first)
    victim = next(i for i, p in enumerate(nodes.procs) if f"node{i + 1}-" in run["hostname"])
    time.sleep(0.5)  # past its first renewal or not: either way the lease is 3 s
    killed = server_us(client)
    os.killpg(nodes.procs[victim].pid, signal.SIGKILL)
    second = nodes.send("leased", 1, 0.1).id
    wait_for(nodes, [second], 30)
    runs = [r for r in nodes.runs() if r["id"] == second]
    assert len(runs) == 1, "the second task never ran"
    started = runs[0]["t"]
    # not before the slot's lease ran out (3 s after its grant or its last renewal: the
    # body starts a moment after its grant, more on a loaded machine), and not long after
    assert started >= (run["granted"] or run["t"]) + 3_000_000
    assert started >= killed
    assert started <= killed + 3_000_000 + 15_000_000  # and it was not left waiting


def test_a_429_pauses_the_key_on_every_node_and_the_task_runs_after_it(
    shared_nodes: Nodes,
) -> None:
    """Task 0's body raises UpstreamRateLimited("2"); once the pause is written, 30
    more tasks of the key are sent: no body of the key starts inside the pause, task
    0 runs again after it without using a retry, nothing is lost."""
    nodes = shared_nodes
    client = nodes.redis()
    first = nodes.send("calls_upstream", 0, 2).id
    settings = f"{nodes.prefix}:{{upstream}}:settings"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not client.hget(settings, "pause"):
        time.sleep(0.01)
    until = int(float(client.hget(settings, "pause") or 0))
    raised = int(client.get(f"{nodes.prefix}:429") or 0)
    assert until >= raised + 2_000_000
    others = [nodes.send("calls_upstream", i, 2).id for i in range(1, 31)]
    ids = [first, *others]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = Counter(r["id"] for r in nodes.runs())
        if all(done[i] >= 1 for i in others) and done[first] >= 2:
            break
        time.sleep(0.1)
    time.sleep(0.5)
    runs = [r for r in nodes.runs() if r["id"] in set(ids)]
    counts = Counter(r["id"] for r in runs)
    assert counts[first] == 2 and all(counts[i] == 1 for i in others)
    inside = [r for r in runs if raised < r["t"] < until]
    assert not inside, f"{len(inside)} bodies started inside the pause"
    rerun = [r for r in runs if r["id"] == first][-1]
    assert rerun["retries"] == 0 and rerun["deferrals"] >= 1
    assert rerun["t"] >= until


def _wait_for_a_handed_turn(url: str, prefix: str, ready: Any) -> None:
    """A waiter of ``leased``: takes a turn in line, then blocks for it to be handed over
    (as a worker does) until it is killed."""
    limiter = Limiter.from_url(url, prefix=prefix)
    leased = [Concurrency(1, key="leased", lease=3)]
    decision = limiter.acquire("leased", leased, reserve=True)
    assert decision.reserved and decision.token
    ready.set()
    while limiter.handed(decision.token, "leased", leased, 1.0) is None:
        pass
    time.sleep(60)  # its turn came: the body it never runs


def test_a_turn_handed_to_a_waiter_whose_worker_died_comes_back_after_its_lease(
    start_nodes: Callable[..., Nodes],
) -> None:
    """Concurrency(1, lease=3): a body runs on a node; a waiter blocked for its turn (as
    a worker blocks) is SIGKILLed; the body ends and hands it the slot; a task sent then
    still runs, once the handed turn's short lease runs out, never beside another body."""
    nodes = start_nodes(count=1)
    first = nodes.send("leased", 0, 1.5).id
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(r["id"] == first for r in nodes.runs()):
        time.sleep(0.05)
    ready = multiprocessing.Event()
    waiter = multiprocessing.Process(
        target=_wait_for_a_handed_turn, args=(nodes.limiter_url, nodes.prefix, ready)
    )
    waiter.start()
    assert ready.wait(10)
    time.sleep(0.2)
    assert waiter.pid is not None
    os.kill(waiter.pid, signal.SIGKILL)
    waiter.join()
    wait_for(nodes, [first], 30)
    second = nodes.send("leased", 1, 0.1).id
    wait_for(nodes, [second], 30)
    runs = Counter(r["id"] for r in nodes.runs())
    assert runs[first] == 1 and runs[second] == 1, "a task was lost or ran twice"
    spans = bodies(nodes, [first, second])
    assert len(spans) == 2 and most_at_once(spans) <= 1
    # the slot was the dead waiter's until its short lease (its turn, before the first
    # body ended, + the 2 s grace) ran out, then came back
    (_, ended), (started, _) = sorted(spans)
    assert ended + 2_000_000 <= started <= ended + 12_000_000
