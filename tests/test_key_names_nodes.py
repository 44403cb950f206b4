"""One key name, one budget, on a real worker node: for each key shape the README
teaches (``api:{k}`` by the base class, ``yt:quota:{k}`` by the decorator, ``{k}:erp``
by the rules), an override set by the CLI holds the task to it, a ``Limiter.pause`` and
another task's ``UpstreamRateLimited(key=...)`` stop it, and a producer's
``Limiter.acquire`` of the rendered key spends its budget, on one redis-server and on a
three-primary Redis Cluster."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_ratelimit import Limit, Limiter
from celery_ratelimit._tools.embedded import start_cluster
from tests.fault_nodes import ROOT, Fleet, print_on_failure
from tests.nodes import unique_prefix
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.celery, pytest.mark.timeout(300)]

RATE = "4/m"
#: task, key template (as the faults app declares them)
DOORS = {"door_api": "api:{k}", "door_quota": "yt:quota:{k}", "door_erp": "{k}:erp"}
#: the tasks sent per door: K-set overridden to 2/m, K-pause paused, K-spent spent by a
#: producer, K-up paused by another task's 429; K-free runs freely
SENT = (("Kset", 4), ("Kpause", 2), ("Kspent", 2), ("Kup", 2), ("Kfree", 2))


@pytest.fixture(params=["server", "cluster"])
def topology(request: pytest.FixtureRequest) -> Iterator[tuple[str, RedisServer]]:
    """(the limiter URL, a plain server for the broker and the runs)."""
    broker = RedisServer()
    cluster: list[RedisServer] = []
    try:
        if request.param == "cluster":
            cluster = start_cluster(3)
            hosts = ",".join(f"127.0.0.1:{node.port}" for node in cluster)
            yield f"redis+cluster://{hosts}", broker
        else:
            yield f"redis://127.0.0.1:{broker.port}/0", broker
    finally:
        for server in [*cluster, broker]:
            server.close()


def cli(*args: str, url: str, prefix: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "celery_ratelimit", *args, "--url", url, "--prefix", prefix],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_an_override_a_pause_and_a_producers_acquire_reach_the_tasks_key(
    topology: tuple[str, RedisServer], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, broker = topology
    prefix = unique_prefix("doors")
    fleet = Fleet(
        tmp_path / "nodes",
        broker_url=f"redis://127.0.0.1:{broker.port}/1",
        limiter_url=url,
        runs_url=f"redis://127.0.0.1:{broker.port}/3",
        prefix=prefix,
        settings={"rate": RATE},
    )
    limiter = Limiter.from_url(url, prefix=prefix)
    try:
        fleet.add(1)
        sent: dict[str, tuple[str, str]] = {}  # id -> (task, what its key went through)
        for template in DOORS.values():
            # each door on a key of its own (SENT)
            cli("set", template.format(k="Kset"), "2/m", url=url, prefix=prefix)
            limiter.pause(template.format(k="Kpause"), 120)
            for _ in range(4):
                assert limiter.acquire(template.format(k="Kspent"), Limit(RATE)).allowed
            fleet.send("upstream_429", template.format(k="Kup"))
        deadline = time.monotonic() + 30
        for template in DOORS.values():  # each 429 has paused its key
            while limiter.peek(template.format(k="Kup"), Limit(RATE)).allowed:
                assert time.monotonic() < deadline, f"{template}: no 429 paused Kup"
                time.sleep(0.1)
        for task in DOORS:
            for door, count in SENT:
                for i in range(count):
                    sent[fleet.send(task, door, i)] = (task, door)
        # the tasks that may run now: the free ones and the override's 2 of each task
        expected = {(t, "Kfree"): 2 for t in DOORS} | {(t, "Kset"): 2 for t in DOORS}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            ran = Counter(sent[r["id"]] for r in fleet.runs() if r["id"] in sent)
            if all(ran[k] >= n for k, n in expected.items()):
                break
            time.sleep(0.2)
        time.sleep(2.0)  # what else would run if a door missed the task's key
        ran = Counter(sent[r["id"]] for r in fleet.runs() if r["id"] in sent)
        assert dict(ran) == expected, (dict(ran), expected)
        # the CLI's status shows each override on the key the tasks count on
        table = cli("status", url=url, prefix=prefix)
        for template in DOORS.values():
            key = template.format(k="Kset")
            row = next(line for line in table.splitlines() if line.startswith(key + " "))
            assert "2/2" in row and "overridden: 2/m" in row, table
    finally:
        limiter.client.close()
        print_on_failure(request, fleet)
        fleet.stop()
