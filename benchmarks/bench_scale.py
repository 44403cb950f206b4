"""Backlogs far above the limit: ``python -m benchmarks.bench_scale [--rate R]``.

Three ``celery worker`` nodes (prefork, concurrency 2) drain backlogs of 10x, 50x and
100x the limit (50/s) sent at once, on each broker. Each drain's figures: limiter calls
and broker publishes per task (the ideal is 2: the first execution, which reserves a
slot and publishes the copy, and the copy's confirmation), drain time / ideal, most
starts in any window / limit, and each node's peak resident memory (its main process
and pool together, sampled every 0.25 s), next to the same nodes' memory before the
first drain. Deferred copies are parked in Redis (``ratelimit_park_after = 2``; the
limiter has a redis-server of its own here, where "auto" would not park); the anchor
drains the largest backlog with parking off, every copy an ETA message in a node.
"""

from __future__ import annotations

import argparse
import math
import threading
from typing import Any

from benchmarks import docs_tables
from benchmarks.bench_celery import Bench, rabbitmq_reachable
from benchmarks.docs_tables import markdown
from benchmarks.output import save
from celery_ratelimit._engine.rate import Rate

RATE = "50/s"
MULTIPLES = (10, 50, 100)


def node_rss_mb(bench: Bench, pool: bool = True) -> list[float]:
    """Each node's resident memory in MB: its main process (the consumer, which holds
    the messages a node has fetched), and with ``pool`` its pool processes too."""
    import psutil

    sizes = []
    for proc in bench.nodes.procs:
        main = psutil.Process(proc.pid)
        tree = [main, *main.children(recursive=True)] if pool else [main]
        sizes.append(sum(p.memory_info().rss for p in tree) / 2**20)
    return sizes


def drain(bench: Bench, rate: Rate, multiple: int) -> dict[str, Any]:
    count = multiple * rate.limit
    ideal = (math.ceil(count / rate.limit) - 1) * rate.window
    peak = [0.0] * len(bench.nodes.procs)
    peak_main = [0.0] * len(bench.nodes.procs)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            for i, mb in enumerate(node_rss_mb(bench)):
                peak[i] = max(peak[i], mb)
            for i, mb in enumerate(node_rss_mb(bench, pool=False)):
                peak_main[i] = max(peak_main[i], mb)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        r = bench.drain("reserved", count, ideal * 4 + 60)
    finally:
        done.set()
        sampler.join()
    executed = max(r["executed"], 1)
    publishes = r.get("broker_lpush") or r["publishes_from_records"]
    return {
        "multiple": multiple,
        "backlog": count,
        "executed": r["executed"],
        "ideal_s": ideal,
        "drain_over_ideal": round(r["drain_s"] / ideal, 3) if r["drain_s"] else None,
        "calls_per_task": round(r["limiter_calls"] / executed, 3),
        "publishes_per_task": round(publishes / executed, 3),
        "starts_over_limit": r["max_starts_per_window"] / rate.limit,
        "server_usec_per_call": r["limiter_usec_per_call"],
        "peak_node_rss_mb": [round(mb, 1) for mb in peak],
        "peak_consumer_rss_mb": [round(mb, 1) for mb in peak_main],
    }


def run(
    broker: str = "redis",
    rate: str = RATE,
    park_after: str = "2",
    multiples: tuple[int, ...] = MULTIPLES,
) -> dict[str, Any]:
    parsed = Rate.parse(rate)
    bench = Bench(broker, parsed, 0, 0, park_after=park_after)
    try:
        bench.nodes.start(bench.tasks.app)
        idle = [round(mb, 1) for mb in node_rss_mb(bench)]
        idle_consumer = [round(mb, 1) for mb in node_rss_mb(bench, pool=False)]
        drains = [drain(bench, parsed, m) for m in multiples]
    finally:
        bench.close()
    return {
        "broker": broker,
        "rate": rate,
        "parked": park_after != "none",
        "idle_node_rss_mb": idle,
        "idle_consumer_rss_mb": idle_consumer,
        "drains": drains,
    }


def run_all(rate: str = RATE) -> list[dict[str, Any]]:
    """Every broker, parked, then the anchor (no park) at the largest backlog."""
    brokers = ["redis"] + (["rabbitmq"] if rabbitmq_reachable() else [])
    results = []
    for broker in brokers:
        results.append(run(broker, rate))
        results.append(run(broker, rate, "none", MULTIPLES[-1:]))
    return results


def table(results: list[dict[str, Any]]) -> list[str]:
    """The markdown table of docs/benchmarks.md, row 10."""
    rows = []
    for r in results:
        idle = max(r["idle_node_rss_mb"])
        consumer = max(r["idle_consumer_rss_mb"])
        for d in r["drains"]:
            peak = d["peak_node_rss_mb"]
            rows.append(
                (
                    "Redis" if r["broker"] == "redis" else "RabbitMQ",
                    f"{d['multiple']}x ({d['backlog']:,})"
                    + ("" if r.get("parked", False) else ", not parked (anchor)"),
                    f"{d['calls_per_task']:.2f}",
                    f"{d['publishes_per_task']:.2f}",
                    f"{d['drain_over_ideal']:.2f}" if d["drain_over_ideal"] else "n/a",
                    f"{d['starts_over_limit']:.2f}",
                    f"{min(peak):.0f}-{max(peak):.0f} MB (idle {idle:.0f})",
                    f"{max(d['peak_consumer_rss_mb']):.0f} MB (idle {consumer:.0f})",
                )
            )
    header = (
        "broker",
        "backlog",
        "limiter calls / task",
        "publishes / task",
        "drain / ideal",
        "most starts in a window / limit",
        "peak node RSS",
        "peak consumer RSS",
    )
    return markdown(header, rows, right=2)


def label(run: dict[str, Any]) -> str:
    return "parked" if run.get("parked", False) else "anchor: not parked"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", default=RATE)
    args = parser.parse_args()
    results = run_all(args.rate)
    save("scale.json", results)
    docs_tables.write("row 10", table(results))
    for r in results:
        print(
            f"{r['broker']} broker, {r['rate']}, {label(r)}; idle nodes {r['idle_node_rss_mb']} MB"
        )
        for d in r["drains"]:
            print(
                f"  {d['multiple']:>3}x ({d['backlog']} tasks): calls/task "
                f"{d['calls_per_task']:.2f}, publishes/task {d['publishes_per_task']:.2f}, "
                f"drain/ideal {d['drain_over_ideal']}, starts/limit {d['starts_over_limit']:.2f}, "
                f"peak node RSS {d['peak_node_rss_mb']} MB, consumer "
                f"{d['peak_consumer_rss_mb']} MB"
            )


if __name__ == "__main__":
    main()
