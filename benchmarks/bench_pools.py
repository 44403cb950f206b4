"""Starts within the limit on every pool: ``python -m benchmarks.bench_pools [--runs N]``.

Three ``celery worker`` nodes of one pool (prefork -c 2, threads -c 30, solo, gevent
-c 50, eventlet -c 50) on a Redis broker drain a backlog of 6x the limit (10/s), ``runs``
times, on an idle machine and with one of the cores kept busy by a spinning process.
Each run's figures: most task *starts* in any window / limit (what an upstream API
sees; bodies stamp their start first thing), most grants in any window / limit (the
limiter's decisions), and how long after its grant a body started at most.

The anchor, in the same run: the same backlog with ``ratelimit_guard=0`` (grants
exact, starts not checked: a grant whose reply a busy process read late runs late), on
the green pools with a busy core, where late replies are most common.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks.bench_celery import Bench
from benchmarks.output import save
from celery_ratelimit._engine.rate import Rate

POOLS = (("prefork", 2), ("threads", 30), ("solo", 1), ("gevent", 50), ("eventlet", 50))
RATE = "10/s"
BACKLOG = 60


@contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """One core kept busy by another process, for the duration (if ``on``)."""
    if not on:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def pool_runs(
    pool: str, concurrency: int, busy: bool, runs: int, task: str = "reserved"
) -> dict[str, Any]:
    rate = Rate.parse(RATE)
    bench = Bench("redis", rate, BACKLOG, 0, pool=pool, concurrency=concurrency)
    starts: list[float] = []
    grants: list[float] = []
    late_ms: list[float] = []
    lost = 0
    try:
        bench.nodes.start(bench.tasks.app)
        with busy_core(busy):
            for _ in range(runs):
                r = bench.drain(task, BACKLOG, 120)
                lost += BACKLOG - r["executed"]
                starts.append(r["max_starts_per_window"] / rate.limit)
                grants.append(r["max_grants_per_window"] / rate.limit)
                late_ms.append(
                    max(s - g for s, g in zip(r["starts_us"], r["grants_us"], strict=True)) / 1000
                )
                time.sleep(rate.window + 0.2)  # the next run starts on an empty window
    finally:
        bench.close()
    return {
        "task": task,
        "pool": f"{pool} -c {concurrency}",
        "busy_core": busy,
        "runs": runs,
        "starts_over_limit": starts,
        "worst_starts_over_limit": max(starts),
        "runs_within_limit": sum(1 for x in starts if x <= 1.0),
        "worst_grants_over_limit": max(grants),
        "max_late_ms": round(max(late_ms), 1),
        "median_max_late_ms": round(statistics.median(late_ms), 1),
        "tasks_not_run": lost,
    }


def run(runs: int = 20) -> list[dict[str, Any]]:
    ours = [
        pool_runs(pool, concurrency, busy, runs)
        for pool, concurrency in POOLS
        for busy in (False, True)
    ]
    anchors = [pool_runs(pool, 50, True, runs, "unchecked") for pool in ("gevent", "eventlet")]
    return ours + anchors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    results = run(args.runs)
    save("pools.json", results)
    for r in results:
        anchor = "anchor, guard 0: " if r["task"] == "unchecked" else ""
        print(
            f"{anchor}{r['pool']:<14} {'busy core' if r['busy_core'] else 'idle':<9} "
            f"starts/limit worst {r['worst_starts_over_limit']:.2f} "
            f"({r['runs_within_limit']}/{r['runs']} runs at <= 1.00), "
            f"grants/limit worst {r['worst_grants_over_limit']:.2f}, "
            f"latest start {r['max_late_ms']} ms after its grant, "
            f"not run {r['tasks_not_run']}"
        )


if __name__ == "__main__":
    main()
