"""Sentinel failover and Redis Cluster, with real redis-server processes on loopback.

- Sentinel: one primary, one replica and one sentinel (``redis-server sentinel.conf
  --sentinel``, down-after 1 s, failover-timeout 3 s), worker nodes on a
  ``redis+sentinel://`` URL; the primary is killed (SIGKILL) in the middle of a drain.
- Cluster: three primaries (``--cluster-enabled yes``, ``redis-cli --cluster create``),
  many tenants with two limits each, then one slot moved by hand (``CLUSTER SETSLOT``
  and ``MIGRATE``) while the client still holds the old slot map.

Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_ratelimit import InvalidLimit, Limit, Limiter
from tests.fault_nodes import (
    Fleet,
    deferred_ids,
    max_grants,
    print_on_failure,
    tally,
    unique_prefix,
)
from tests.redis_server import RedisServer, free_port, redis_binary

pytestmark = [pytest.mark.celery, pytest.mark.timeout(240)]

LIMIT, WINDOW_US = 10, 1_000_000


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# -- Sentinel ---------------------------------------------------------------------------


class Sentinel:
    """A ``redis-server --sentinel`` watching ``mymaster`` with quick failure detection."""

    def __init__(self, directory: Path, primary_port: int) -> None:
        self.port = free_port()
        conf = directory / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {directory}\n"
            f"logfile {directory / 'sentinel.log'}\n"
            f"sentinel monitor mymaster 127.0.0.1 {primary_port} 1\n"
            "sentinel down-after-milliseconds mymaster 1000\n"
            "sentinel failover-timeout mymaster 3000\n"
            "sentinel parallel-syncs mymaster 1\n"
        )
        binary = redis_binary()
        assert binary is not None
        self.proc = subprocess.Popen(
            [binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.client = redis.Redis(port=self.port, socket_timeout=1)

    def primary(self) -> int:
        _host, port = self.client.sentinel_get_master_addr_by_name("mymaster")
        return int(port)

    def close(self) -> None:
        self.client.close()
        self.proc.kill()
        self.proc.wait(5)


@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer, Sentinel]]:
    primary = RedisServer()
    replica = RedisServer("--replicaof", "127.0.0.1", str(primary.port))
    sentinel = Sentinel(tmp_path, primary.port)
    try:
        wait_until(
            lambda: replica.client().info("replication")["master_link_status"] == "up",
            15,
            "the replica to sync",
        )
        wait_until(
            lambda: len(sentinel.client.sentinel_slaves("mymaster")) == 1,
            20,
            "the sentinel to discover the replica",
        )
        yield primary, replica, sentinel
    finally:
        sentinel.close()
        replica.close()
        primary.close()


def test_sentinel_failover_mid_drain_loses_no_task(
    sentinel_set: tuple[RedisServer, RedisServer, Sentinel],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    primary, replica, sentinel = sentinel_set
    broker = RedisServer()
    fleet = Fleet(
        tmp_path / "nodes",
        broker_url=f"redis://127.0.0.1:{broker.port}/1",
        limiter_url=f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster/0",
        runs_url=f"redis://127.0.0.1:{broker.port}/3",
        prefix=unique_prefix("sentinel"),
        settings={"rate": f"{LIMIT}/s", "error_countdown": "0.5"},
    )
    try:
        fleet.add(2)
        ids = [fleet.send("limited", i) for i in range(60)]
        time.sleep(1.5)
        killed_at = time.time()
        assert primary.proc is not None
        primary.proc.send_signal(signal.SIGKILL)
        primary.proc.wait()
        primary.proc = None
        wait_until(lambda: sentinel.primary() == replica.port, 20, "the failover")
        failover_s = time.time() - killed_at
        runs = fleet.wait_for_runs(ids, 40)
        counts = tally(ids, runs)
        failed_decisions = fleet.grep("; Redis error:")
        deferred_by_error = deferred_ids(failed_decisions)
        errors = fleet.grep("raised unexpected")
        kill_us = int(killed_at * 1_000_000)
        before = [r for r in runs if r["granted"] < kill_us]
        after = [r for r in runs if r["granted"] >= kill_us]
        print(
            f"\n[sentinel failover] {counts}; failover took {failover_s:.1f}s; "
            f"{len(failed_decisions)} decisions failed during it ({len(deferred_by_error)} "
            f"tasks deferred by 'defer', all of which ran: "
            f"{deferred_by_error <= {r['id'] for r in runs}}); max grants/window before "
            f"the kill {max_grants(before, WINDOW_US)}, after {max_grants(after, WINDOW_US)}, "
            f"across {max_grants(runs, WINDOW_US)}; task errors {len(errors)}"
        )
        assert counts["lost"] == counts["duplicated"] == 0, counts
        assert not errors
        assert failed_decisions, "the kill should have failed some decisions"
        assert deferred_by_error <= {r["id"] for r in runs}
        assert max_grants(before, WINDOW_US) <= LIMIT
        assert max_grants(after, WINDOW_US) <= LIMIT
        # the new primary is the old replica, and the limiter wrote there
        keys = replica.client().keys(f"{fleet.prefix}:*")
        assert keys
    finally:
        print_on_failure(request, fleet)
        fleet.stop()
        broker.close()


# -- Cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisServer]]:
    # the cluster bus listens on port + 10000 unless told otherwise, and free ports are
    # often above 55535: give each node a bus port of its own
    nodes = [
        RedisServer(
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "2000",
            "--cluster-port",
            str(free_port()),
        )
        for _ in range(3)
    ]
    try:
        cli = redis_binary("redis-cli")
        assert cli is not None
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        for node in nodes:
            wait_until(
                lambda node=node: node.client().cluster("info")["cluster_state"] == "ok",
                20,
                "the cluster to be ok",
            )
        yield nodes
    finally:
        for node in nodes:
            node.close()


def node_id(server: RedisServer) -> str:
    return str(server.client().execute_command("CLUSTER", "MYID").decode())


def move_slot(nodes: list[RedisServer], slot: int, source: RedisServer, target: RedisServer) -> int:
    """Move ``slot`` and its keys from ``source`` to ``target`` (what ``redis-cli
    --cluster reshard`` does); returns the number of keys moved."""
    src, dst = node_id(source), node_id(target)
    target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src)
    source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst)
    keys = source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if keys:
        source.client().execute_command(
            "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys
        )
    for node in nodes:
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst)
    return len(keys)


def test_cluster_spreads_tenants_over_shards_keeps_each_call_in_one_slot_and_follows_moved(
    cluster: list[RedisServer],
) -> None:
    ports = ",".join(f"127.0.0.1:{n.port}" for n in cluster[:2])
    limiter = Limiter.from_url(f"redis+cluster://{ports}", prefix="cl")
    tenants = 300
    for t in range(tenants):
        limits = [Limit("5/m", key=f"t{t}:calls"), Limit("100/h", key=f"t{t}:units", cost=10)]
        for _ in range(3):
            assert limiter.acquire(f"t{t}", limits).allowed
    per_node = [n.client().dbsize() for n in cluster]
    assert sum(per_node) == 2 * tenants
    assert min(per_node) > tenants * 2 // 10, per_node  # every shard holds a fair share
    # both keys of a call in one slot: CROSSSLOT would have raised above; check directly
    client = limiter.client
    slots = Counter()
    for t in range(tenants):
        keys = limiter.keys_for(
            f"t{t}", [Limit("5/m", key=f"t{t}:calls"), Limit("100/h", key=f"t{t}:units")]
        )
        assert len({client.keyslot(k) for k in keys}) == 1
        slots[client.keyslot(keys[0])] += 1
    # limits of one call with different hash tags are refused before reaching Redis
    with pytest.raises(InvalidLimit, match="hash tag"):
        limiter.acquire("x", [Limit("5/m", key="a:calls"), Limit("100/h", key="b:units")])

    # reshard: move tenant t0's slot to another primary behind the client's back
    keys = limiter.keys_for("t0", [Limit("5/m", key="t0:calls"), Limit("100/h", key="t0:units")])
    slot = client.keyslot(keys[0])
    source = next(
        n for n in cluster if n.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
    )
    target = next(n for n in cluster if n is not source)
    moved = move_slot(cluster, slot, source, target)
    assert moved >= 2
    limits = [Limit("5/m", key="t0:calls"), Limit("100/h", key="t0:units", cost=10)]
    answers = [limiter.acquire("t0", limits).allowed for _ in range(3)]
    # the budget moved with the keys: 3 of 5 were used before, 2 more fit, then denied
    assert answers == [True, True, False]
    assert target.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) >= 2
    assert source.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    print(
        f"\n[cluster] {tenants} tenants x 2 limits: keys per shard {per_node}, "
        f"{len(slots)} distinct slots, no CROSSSLOT; slot {slot} moved ({moved} keys) "
        f"from :{source.port} to :{target.port}: next calls {answers} (MOVED followed, "
        "budget carried over)"
    )
    limiter.client.close()


def test_worker_nodes_on_a_cluster_url_hold_the_limit(
    cluster: list[RedisServer], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    broker = RedisServer()
    fleet = Fleet(
        tmp_path / "nodes",
        broker_url=f"redis://127.0.0.1:{broker.port}/1",
        limiter_url=f"redis+cluster://127.0.0.1:{cluster[0].port}",
        runs_url=f"redis://127.0.0.1:{broker.port}/3",
        prefix=unique_prefix("cluster"),
        settings={"rate": f"{LIMIT}/s"},
    )
    try:
        fleet.add(2)
        ids = [fleet.send("limited", i) for i in range(30)]
        runs = fleet.wait_for_runs(ids, 30)
        counts = tally(ids, runs)
        print(
            f"\n[cluster, worker nodes] {counts}, max grants/window {max_grants(runs, WINDOW_US)}"
        )
        assert counts["lost"] == counts["duplicated"] == 0, counts
        assert max_grants(runs, WINDOW_US) <= LIMIT
    finally:
        print_on_failure(request, fleet)
        fleet.stop()
        broker.close()
