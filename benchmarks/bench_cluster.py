"""Scaling out: ``python -m benchmarks.bench_cluster [--seconds S] [--clients N]``.

- Decisions per second: N client processes, each with a limiter of its own making one
  decision at a time on the per-tenant keys of 300 tenants (``api:{tenant}``, a limit
  none of them reaches), against one redis-server and against a Redis Cluster of three
  primaries (``redis+cluster://`` naming all three), both on this machine. The clients
  and the servers share its cores: on a machine of two, three primaries cannot give
  three times one's rate; the figure says what the cluster costs a decision here, not
  what it gives on hosts of their own.
- Spread: which primary holds each of 300 tenants' keys under the hash tag (a key's
  first and last segments, ``api:<tenant>``), beside the first segment alone (``api``,
  one tag for every tenant), by the cluster's own slot map.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections import Counter
from typing import Any

from redis.crc import key_slot

from benchmarks.docs_tables import markdown
from benchmarks.output import publish
from celery_ratelimit import Limit, Limiter
from celery_ratelimit._engine.keys import render
from celery_ratelimit._tools.embedded import RedisServer, start_cluster

TENANTS = 300
LIMIT = Limit("1000000/s")
PREFIX = "bench"


def tenant_keys() -> list[str]:
    """Each tenant's key, as a task keyed ``api:{tenant}`` renders it."""
    return [render("api:{tenant}", {"tenant": f"t{n}"}, ()) for n in range(TENANTS)]


def _client(url: str, seconds: float, start: Any, out: Any) -> None:
    limiter = Limiter.from_url(url, prefix=PREFIX)
    keys = tenant_keys()
    limiter.acquire([keys[0]], LIMIT)  # connected, scripts loaded
    start.wait()
    done, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        limiter.acquire([keys[done % TENANTS]], LIMIT)
        done += 1
    out.put(done)


def decisions_per_second(url: str, clients: int, seconds: float) -> float:
    """Decisions per second of ``clients`` processes, each one at a time, together."""
    context = multiprocessing.get_context("spawn")
    start, out = context.Event(), context.Queue()
    procs = [
        context.Process(target=_client, args=(url, seconds, start, out)) for _ in range(clients)
    ]
    for proc in procs:
        proc.start()
    time.sleep(2.0)  # every client connected
    start.set()
    total = sum(out.get(timeout=seconds + 60) for _ in procs)
    for proc in procs:
        proc.join(10)
    return total / seconds


def slot_owners(node: RedisServer) -> dict[int, int]:
    """Slot -> the port of the primary serving it, from ``CLUSTER SLOTS``."""
    owners = {}
    for low, high, primary, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
        for slot in range(int(low), int(high) + 1):
            owners[slot] = int(primary[1])
    return owners


def spread(nodes: list[RedisServer]) -> dict[str, list[int]]:
    """Keys per primary for 300 tenants: with the tag, and with the first segment alone."""
    owners = slot_owners(nodes[0])
    ports = [node.port for node in nodes]
    limiter = Limiter.from_url(nodes[0].url, prefix=PREFIX)  # names only: no call sent
    names = [limiter.keys_for([key], LIMIT)[0] for key in tenant_keys()]
    tagged = Counter(owners[key_slot(name.encode())] for name in names)
    first = Counter(
        owners[key_slot(f"{PREFIX}:{{api}}:api:t{n}:log:1000000".encode())] for n in range(TENANTS)
    )
    return {
        "tagged": [tagged[port] for port in ports],
        "first_segment": [first[port] for port in ports],
    }


def run(clients: int = 4, seconds: float = 5.0) -> dict[str, Any]:
    results: dict[str, Any] = {
        "clients": clients,
        "seconds": seconds,
        "tenants": TENANTS,
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 1),  # the other work sharing the cores
    }
    with RedisServer() as server:
        results["one_server"] = decisions_per_second(server.url, clients, seconds)
    nodes = start_cluster(3)
    try:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in nodes)
        url = f"redis+cluster://{hosts}"
        results["cluster_3"] = decisions_per_second(url, clients, seconds)
        results["spread"] = spread(nodes)
        results["keys_per_primary_live"] = [node.client().dbsize() for node in nodes]
    finally:
        for node in nodes:
            node.close()
    return results


def table(results: dict[str, Any]) -> list[str]:
    spread_ = results["spread"]
    rows = [
        ("decisions/s, one redis-server", f"{results['one_server']:,.0f}"),
        ("decisions/s, Cluster of 3 primaries", f"{results['cluster_3']:,.0f}"),
        (
            f"keys of {results['tenants']} tenants per primary, tag `api:<tenant>`",
            " / ".join(map(str, spread_["tagged"])),
        ),
        (
            "same, tag `api` (the first segment alone)",
            " / ".join(map(str, spread_["first_segment"])),
        ),
    ]
    return [
        f"{results['clients']} client processes, {results['seconds']:g} s each, "
        f"servers and clients on the same machine ({results['cpus']} vCPUs, load average "
        f"{results['load_average']:g} when it began):",
        "",
        *markdown(("figure", "measured"), rows),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    results = run(args.clients, args.seconds)
    publish("cluster.json", results, table(results), "scaling out")


if __name__ == "__main__":
    main()
