"""Starts of a cold flood on the green pools: ``python -m benchmarks.bench_flood [--runs N]``.

Three ``celery worker`` nodes of gevent -c 50 (then eventlet -c 50) are started cold
(fresh processes, fresh redis-servers, so fresh keys) and sent 100 tasks at once at
10/s, ``runs`` times each, on an idle machine and with one of the cores kept busy by a
spinning process. Every greenlet takes a task at once: ten run, ninety are denied and
publish their copies while the ten bodies make their first request. Each body stamps
its first line (this process's clock, Redis's: one machine) and its first I/O (its
first Redis command, a script that reads ``TIME`` as the server runs it: what an
upstream sees). Each run's figures: most first lines and most first I/Os in any 1 s
window / limit, and how long after its first line a body's first I/O reached the
server (the hub's latency for that body).

``--timeline`` prints each run's first twenty starts: when the decision was sent, the
server's time of it, when its reply was read, the first line and the first I/O (ms
from the first line; the nodes run with ``CRL_BENCH_FLOOD_TRACE=1``).

``--setting name=value`` runs the nodes with an extra ``app.conf`` setting (repeatable);
``--rate 10/1.1s`` declares the task's limit with a margin (windows still counted at
1 s against 10: what an upstream allowing 10 a second sees).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

from benchmarks.bench_celery import Bench
from benchmarks.bench_pools import busy_core
from benchmarks.output import save
from celery_ratelimit._engine.rate import Rate
from tests.measure import max_in_window

POOLS = (("gevent", 50), ("eventlet", 50))
RATE = "10/s"
TASKS = 100


def one_run(
    pool: str, concurrency: int, busy: bool, settings: dict[str, Any], declared: str = RATE
) -> dict[str, Any]:
    """One cold flood: nodes started, the tasks sent at once, every stamp read back;
    the task limited at ``declared``, its starts counted against RATE."""
    rate = Rate.parse(RATE)
    bench = Bench(
        "redis",
        rate,
        TASKS,
        0,
        pool=pool,
        concurrency=concurrency,
        settings=settings,
    )
    bench.nodes.env["CRL_BENCH_FLOOD_RATE"] = declared
    try:
        bench.nodes.start(bench.tasks.app)
        with busy_core(busy):
            for _ in range(TASKS):
                bench.tasks.flood.delay()
            deadline = time.monotonic() + TASKS / rate.limit * 4 + 30
            while bench.client.llen("bench:runs:flood") < TASKS and time.monotonic() < deadline:
                time.sleep(0.1)
        time.sleep(0.3)  # a duplicate, if any, shows up
        rows = [
            [int(x) for x in raw.split()] for raw in bench.client.lrange("bench:runs:flood", 0, -1)
        ]
    finally:
        bench.close()
    lines = [r[0] for r in rows]
    ios = [r[1] for r in rows]
    gaps_ms = [(io - line) / 1000 for line, io, *_ in rows]
    return {
        "executed": len(rows),
        "lines_over_limit": max_in_window(lines, rate.window_us) / rate.limit,
        "ios_over_limit": max_in_window(ios, rate.window_us) / rate.limit,
        "max_io_after_line_ms": round(max(gaps_ms), 1),
        "median_io_after_line_ms": round(statistics.median(gaps_ms), 1),
        "max_line_after_grant_ms": round(max((r[0] - r[2]) / 1000 for r in rows), 1),
        "drain_s": (max(lines) - min(lines)) / 1e6,
        "deferrals_per_task": sum(r[3] for r in rows) / len(rows),
        "rows": rows,  # first line, first I/O, granted (us), deferrals
    }


def timeline(rows: list[list[int]]) -> str:
    """The first twenty starts of a traced run (``CRL_BENCH_FLOOD_TRACE``), one a line:
    decision sent, decided (server), reply read, first line, first I/O, in ms from the
    first line; then the I/O's lag behind the line, the deferrals and the node's pid."""
    ordered = sorted(rows)
    t0 = ordered[0][0]
    lines = ["   sent decided   read   line    I/O    lag deferrals pid"]
    for line, io, granted, deferrals, sent, read, pid in ordered[:20]:
        ms = [(t - t0) / 1000 for t in (sent, granted, read, line, io)]
        lines.append(
            " ".join(f"{x:6.1f}" for x in ms) + f" {(io - line) / 1000:6.1f} {deferrals} {pid}"
        )
    return "\n".join(lines)


def flood_runs(
    pool: str,
    concurrency: int,
    busy: bool,
    runs: int,
    settings: dict[str, Any],
    declared: str = RATE,
) -> dict[str, Any]:
    each = [one_run(pool, concurrency, busy, settings, declared) for _ in range(runs)]
    lines = [r["lines_over_limit"] for r in each]
    ios = [r["ios_over_limit"] for r in each]
    return {
        "pool": f"{pool} -c {concurrency}",
        "busy_core": busy,
        "settings": settings,
        "declared": declared,
        "runs": runs,
        "lines_over_limit": lines,
        "ios_over_limit": ios,
        "worst_lines_over_limit": max(lines),
        "worst_ios_over_limit": max(ios),
        "runs_lines_within_limit": sum(1 for x in lines if x <= 1.0),
        "runs_ios_within_limit": sum(1 for x in ios if x <= 1.0),
        "max_io_after_line_ms": max(r["max_io_after_line_ms"] for r in each),
        "median_max_io_after_line_ms": statistics.median(r["max_io_after_line_ms"] for r in each),
        "max_line_after_grant_ms": max(r["max_line_after_grant_ms"] for r in each),
        "tasks_not_run": sum(TASKS - r["executed"] for r in each),
        "median_drain_over_ideal": statistics.median(r["drain_s"] for r in each) / ideal_s(),
        "median_deferrals_per_task": statistics.median(r["deferrals_per_task"] for r in each),
    }


def ideal_s() -> float:
    """The ideal drain of TASKS at RATE: first start to last, one window per limit."""
    rate = Rate.parse(RATE)
    return (math.ceil(TASKS / rate.limit) - 1) * rate.window


def run(runs: int = 3, settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [
        flood_runs(pool, concurrency, busy, runs, settings or {})
        for pool, concurrency in POOLS
        for busy in (False, True)
    ]


def describe(r: dict[str, Any]) -> str:
    shown = " ".join(f"{k}={v}" for k, v in r["settings"].items()) or "default settings"
    if r["declared"] != RATE:
        shown += f", declared {r['declared']}"
    return (
        f"{r['pool']:<14} {'busy core' if r['busy_core'] else 'idle':<9} {shown}: "
        f"by first line worst {r['worst_lines_over_limit']:.2f} "
        f"({r['runs_lines_within_limit']}/{r['runs']} at <= 1.00), "
        f"by first I/O worst {r['worst_ios_over_limit']:.2f} "
        f"({r['runs_ios_within_limit']}/{r['runs']} at <= 1.00), "
        f"first I/O after first line at most {r['max_io_after_line_ms']} ms, "
        f"not run {r['tasks_not_run']}, drain / ideal {r['median_drain_over_ideal']:.2f}, "
        f"deferrals per task {r['median_deferrals_per_task']:.2f} (medians)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pool", choices=[p for p, _ in POOLS], action="append")
    parser.add_argument("--busy", choices=("idle", "busy", "both"), default="both")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--rate", default=RATE, help="the task's declared limit")
    parser.add_argument("--out", default="flood.json", help="file name in benchmarks/results")
    parser.add_argument("--timeline", action="store_true", help="print each run's first starts")
    args = parser.parse_args()
    settings = {k: json.loads(v) for k, _, v in (s.partition("=") for s in args.setting)}
    if args.timeline:
        os.environ["CRL_BENCH_FLOOD_TRACE"] = "1"
        for pool, concurrency in POOLS:
            if not args.pool or pool in args.pool:
                for _ in range(args.runs):
                    run = one_run(pool, concurrency, args.busy == "busy", settings, args.rate)
                    print(
                        f"{pool}: by first line {run['lines_over_limit']:.2f}, "
                        f"by first I/O {run['ios_over_limit']:.2f}"
                    )
                    print(timeline(run["rows"]))
        return
    results = [
        flood_runs(pool, concurrency, busy, args.runs, settings, args.rate)
        for pool, concurrency in POOLS
        if not args.pool or pool in args.pool
        for busy in {"idle": (False,), "busy": (True,), "both": (False, True)}[args.busy]
    ]
    save(args.out, results)
    for r in results:
        print(describe(r))


if __name__ == "__main__":
    main()
