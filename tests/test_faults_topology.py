"""Sentinel failover and Redis Cluster, with real redis-server processes on loopback.

Worker nodes run with default settings on the README's URL forms, every host named:
``redis+sentinel://h:p,h:p,h:p/mymaster/0`` and ``redis+cluster://h:p,h:p,h:p``.

- Sentinel: one primary, one replica and three sentinels (``redis-server sentinel.conf
  --sentinel``, quorum 2, down-after 1 s, failover-timeout 3 s). With the broker on the
  same Sentinel group (kombu's ``sentinel://``) copies are parked there; with a broker
  of its own the park stays off (saying so once) and the primary is killed (SIGKILL) in
  the middle of a drain.
- Cluster: three primaries (``--cluster-enabled yes``, ``redis-cli --cluster create``),
  many tenants with two limits each, then one slot moved by hand (``CLUSTER SETSLOT``
  and ``MIGRATE``) while the client still holds the old slot map; worker nodes on
  per-tenant keys (``api:{tenant}``), whose keys land on several primaries.

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
from celery_ratelimit._tools.embedded import start_cluster
from tests.fault_nodes import Fleet, deferred_ids, max_grants, print_on_failure, tally
from tests.nodes import unique_prefix
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

    def __init__(self, directory: Path, primary_port: int, quorum: int = 2) -> None:
        self.port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        conf = directory / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {directory}\n"
            f"logfile {directory / 'sentinel.log'}\n"
            f"sentinel monitor mymaster 127.0.0.1 {primary_port} {quorum}\n"
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


SentinelSet = tuple[RedisServer, RedisServer, list["Sentinel"]]


@pytest.fixture(scope="module")
def sentinel_set(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    """A primary, its replica and three sentinels (quorum 2), for the whole module: the
    failover test, which kills the primary, comes last."""
    directory = tmp_path_factory.mktemp("sentinels")
    primary = RedisServer()
    replica = RedisServer("--replicaof", "127.0.0.1", str(primary.port))
    sentinels = [Sentinel(directory / f"s{n}", primary.port) for n in range(3)]
    try:
        wait_until(
            lambda: replica.client().info("replication")["master_link_status"] == "up",
            15,
            "the replica to sync",
        )
        for sentinel in sentinels:
            wait_until(
                lambda s=sentinel: (
                    len(s.client.sentinel_slaves("mymaster")) == 1
                    and len(s.client.sentinel_sentinels("mymaster")) == 2
                ),
                30,
                "each sentinel to discover the replica and the other sentinels",
            )
        yield primary, replica, sentinels
    finally:
        for sentinel in sentinels:
            sentinel.close()
        replica.close()
        primary.close()


def sentinel_url(sentinels: list[Sentinel]) -> str:
    """The README's form: every sentinel named."""
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
    return f"redis+sentinel://{hosts}/mymaster/0"


def parked(server: RedisServer, prefix: str) -> int:
    """Copies parked under ``prefix`` on ``server``, by the park's own counts."""
    client = server.client()
    keys = list(client.scan_iter(match=f"{prefix}:{{park:*}}:counts"))
    total = sum(int(client.hget(key, "park") or 0) for key in keys)
    client.close()
    return total


def test_a_broker_on_the_same_sentinel_group_parks_there(
    sentinel_set: SentinelSet, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    primary, _replica, sentinels = sentinel_set
    runs = RedisServer()
    fleet = Fleet(
        tmp_path / "nodes",
        # kombu's Sentinel transport, on the limiter's sentinels and service
        broker_url=";".join(f"sentinel://127.0.0.1:{s.port}/1" for s in sentinels),
        limiter_url=sentinel_url(sentinels),
        runs_url=runs.url,
        prefix=unique_prefix("sentinel-park"),
        settings={"rate": f"{LIMIT}/s", "master_name": "mymaster"},
    )
    try:
        fleet.add(2)
        ids = [fleet.send("limited", i) for i in range(45)]
        done = fleet.wait_for_runs(ids, 60)
        counts = tally(ids, done)
        copies = parked(primary, fleet.prefix)
        print(f"\n[sentinel broker and limiter] {counts}; {copies} copies parked")
        assert counts["lost"] == counts["duplicated"] == 0, counts
        assert max_grants(done, WINDOW_US) <= LIMIT
        assert copies > 0  # the same server as the broker's: parked there
        assert not fleet.grep("cannot tell whether")
        assert not fleet.grep("ERROR")
    finally:
        print_on_failure(request, fleet)
        fleet.stop()
        runs.close()


def test_sentinel_failover_mid_drain_loses_no_task(
    sentinel_set: SentinelSet, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    primary, replica, sentinels = sentinel_set
    sentinel = sentinels[0]
    broker = RedisServer()
    fleet = Fleet(
        tmp_path / "nodes",
        broker_url=f"redis://127.0.0.1:{broker.port}/1",
        limiter_url=sentinel_url(sentinels),
        runs_url=f"redis://127.0.0.1:{broker.port}/3",
        prefix=unique_prefix("sentinel"),
        settings={"rate": f"{LIMIT}/s"},
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
        # a broker of its own: "auto" cannot tell it from the Sentinel's primary, so it
        # parks nothing and says so once per node, at INFO
        notes = fleet.grep("cannot tell whether")
        assert len(notes) == 2 and all("INFO" in line for line in notes), notes
        assert parked(replica, fleet.prefix) == 0
    finally:
        print_on_failure(request, fleet)
        fleet.stop()
        broker.close()


# -- Cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisServer]]:
    nodes = start_cluster(3)
    yield nodes
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

    def stacked(t: int, cost: int = 1) -> list[Limit]:
        # the tag is the first and last segments: both limits of a tenant share "api:t<t>"
        return [
            Limit("5/m", key=f"api:calls:t{t}"),
            Limit("100/h", key=f"api:units:t{t}", cost=cost),
        ]

    for t in range(tenants):
        for _ in range(3):
            assert limiter.acquire(f"t{t}", stacked(t, 10)).allowed
        # the README's per-tenant key, given as the string a task renders
        assert limiter.acquire(f"api:t{t}", Limit("5/m")).allowed
    per_node = [n.client().dbsize() for n in cluster]
    assert sum(per_node) == 3 * tenants
    # every shard holds a fair share: none above 40% of the tenants' keys
    assert max(per_node) <= 0.4 * sum(per_node), per_node
    # both keys of a call in one slot: CROSSSLOT would have raised above; check directly
    client = limiter.client
    slots = Counter()
    for t in range(tenants):
        keys = limiter.keys_for(f"t{t}", stacked(t))
        assert len({client.keyslot(k) for k in keys}) == 1
        slots[client.keyslot(keys[0])] += 1
    # limits of one call with different hash tags are refused before reaching Redis,
    # naming what shares a tag
    with pytest.raises(InvalidLimit, match="first and last segments"):
        limiter.acquire("x", [Limit("5/m", key="a:calls"), Limit("100/h", key="b:units")])
    # a tag of the keys' own, in braces, puts them in one slot (a Limit's key is a
    # template: its braces doubled; as strings given to acquire, as they are)
    own = [Limit("5/m", key="{{a}}:calls"), Limit("100/h", key="{{a}}:units")]
    assert limiter.acquire("x", own).allowed
    assert limiter.acquire(["{a}:calls", "{a}:units"], [Limit("5/m"), Limit("100/h")]).allowed
    assert limiter.peek("{a}:calls", Limit("5/m")).remaining == 3

    # reshard: move tenant t0's slot to another primary behind the client's back
    keys = limiter.keys_for("t0", stacked(0))
    slot = client.keyslot(keys[0])
    source = next(
        n for n in cluster if n.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
    )
    target = next(n for n in cluster if n is not source)
    moved = move_slot(cluster, slot, source, target)
    assert moved >= 2
    answers = [limiter.acquire("t0", stacked(0, 10)).allowed for _ in range(3)]
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


def test_worker_nodes_on_a_cluster_url_hold_the_limit_and_spread_tenants(
    cluster: list[RedisServer], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    broker = RedisServer()
    hosts = ",".join(f"127.0.0.1:{node.port}" for node in cluster)
    fleet = Fleet(
        tmp_path / "nodes",
        broker_url=f"redis://127.0.0.1:{broker.port}/1",
        limiter_url=f"redis+cluster://{hosts}",
        runs_url=f"redis://127.0.0.1:{broker.port}/3",
        prefix=unique_prefix("cluster"),
        settings={"rate": f"{LIMIT}/s"},
    )
    tenants = [f"tenant{n}" for n in range(8)]
    try:
        fleet.add(2)
        ids = [fleet.send("limited", i) for i in range(25)]
        by_tenant = {t: [fleet.send("per_tenant", t, i) for i in range(15)] for t in tenants}
        every = ids + [i for sent in by_tenant.values() for i in sent]
        # which primary holds each tenant's key, looked at while the drain runs (a key
        # expires a moment after its window once idle)
        holders: dict[str, set[int]] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for node in cluster:
                for key in node.client().scan_iter(match=f"{fleet.prefix}:{{api:*"):
                    holders.setdefault(key.decode().split("}")[0], set()).add(node.port)
            if {r["id"] for r in fleet.runs()} >= set(every):
                break
            time.sleep(0.2)
        runs = fleet.wait_for_runs(every, 10)
        counts = tally(every, runs)
        primaries = {port for ports in holders.values() for port in ports}
        print(
            f"\n[cluster, worker nodes] {counts}, max grants/window "
            f"{max_grants([r for r in runs if r['id'] in ids], WINDOW_US)} (shared key); "
            f"{len(holders)} tenants' keys seen on {len(primaries)} of 3 primaries"
        )
        assert counts["lost"] == counts["duplicated"] == 0, counts
        assert max_grants([r for r in runs if r["id"] in ids], WINDOW_US) <= LIMIT
        for sent in by_tenant.values():
            assert max_grants([r for r in runs if r["id"] in sent], WINDOW_US) <= LIMIT
        assert len(primaries) > 1, holders  # the tenants' keys spread over the shards
        # the broker is no node of the cluster: nothing parked, said once per node
        notes = fleet.grep("cannot tell whether")
        assert len(notes) == 2 and all("INFO" in line for line in notes), notes
        assert not fleet.grep("ERROR")
    finally:
        print_on_failure(request, fleet)
        fleet.stop()
        broker.close()
