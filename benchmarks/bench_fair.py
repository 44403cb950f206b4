"""Fair shares across tenants: ``python -m benchmarks.bench_fair [--quick]``.

Three ``celery worker`` nodes (prefork, concurrency 2) share one ``10/s`` budget, each
scenario run twice in the same run: with ``fair_key="{tenant}"`` (``fair_tenant``) and
without (``fifo_tenant``, slots in arrival order, the anchor).

1. The noisy neighbour: tenant A sends 200 tasks (100 with ``--quick``), tenant B 5
   tasks 3 s later. B's worst wait (its send to its task's start), A's drain
   utilization (the ideal drain of every task at the limit / the drain measured, first
   start to last), the most starts in any window / the limit, limiter calls per task
   (EVALSHA calls less the park's, as rows 6-7 count them).
2. Two floods weighted 3:1: "heavy" (weight 3) and "light" (weight 1) send 150 tasks
   each (60 with ``--quick``), interleaved, at once: heavy's share of the starts while
   both flood (after the first window, which runs at once in arrival order, until one
   of them has less than a window's worth left), and how many of that tenant's tasks
   started after that point (moved to the back by a swap: stragglers).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from benchmarks.bench_celery import Bench
from benchmarks.docs_tables import markdown
from benchmarks.output import publish
from celery_ratelimit._celery.park import park_calls
from celery_ratelimit._engine.rate import Rate
from tests.measure import max_in_window, server_us

RATE = Rate.parse("10/s")
B_AFTER = 3.0
B_TASKS = 5


def _collect(bench: Bench, name: str, count: int, timeout: float) -> list[tuple[int, int, str]]:
    key = f"bench:runs:{name}"
    deadline = time.monotonic() + timeout
    while bench.client.llen(key) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # let a duplicate, if any, show up
    rows = []
    for raw in bench.client.lrange(key, 0, -1):
        started, granted, _deferrals, tenant = raw.split()
        rows.append((int(started), int(granted), tenant))
    return rows


def _calls(bench: Bench) -> int:
    stats = bench.client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))


def _ideal_s(tasks: int) -> float:
    """The drain of ``tasks`` at the limit: a window's worth at once, then one window
    for each further limit's worth."""
    return (math.ceil(tasks / RATE.limit) - 1) * RATE.window_us / 1e6


def _begin(bench: Bench, name: str) -> tuple[Any, int]:
    """A scenario's task, its runs and the server's call counts cleared; returns the task
    and the park's calls so far (left out of the limiter calls, as in rows 6-7)."""
    bench.client.delete(f"bench:runs:{name}")
    bench.client.config_resetstat()
    return getattr(bench.tasks, name), park_calls(bench.client, "bench")


def _limiter_calls(bench: Bench, park_before: int) -> int:
    return _calls(bench) - (park_calls(bench.client, "bench") - park_before)


def neighbour(bench: Bench, name: str, a_tasks: int) -> dict[str, Any]:
    task, park_before = _begin(bench, name)
    for _ in range(a_tasks):
        task.delay("A")
    time.sleep(B_AFTER)
    sent_b = server_us(bench.client)
    for _ in range(B_TASKS):
        task.delay("B")
    count = a_tasks + B_TASKS
    rows = _collect(bench, name, count, _ideal_s(count) * 3 + 60)
    calls = _limiter_calls(bench, park_before)
    starts = [s for s, _, _ in rows]
    b_starts = [s for s, _, tenant in rows if tenant == "B"]
    span = (max(starts) - min(starts)) / 1e6
    return {
        "task": name,
        "sent": count,
        "executed": len(rows),
        "b_worst_wait_s": round((max(b_starts) - sent_b) / 1e6, 2),
        "b_waits_s": sorted(round((s - sent_b) / 1e6, 2) for s in b_starts),
        "drain_utilization": round(_ideal_s(count) / span, 3),
        "starts_over_limit": round(max_in_window(starts, RATE.window_us) / RATE.limit, 2),
        "grants_over_limit": round(
            max_in_window([g for _, g, _ in rows], RATE.window_us) / RATE.limit, 2
        ),
        "calls_per_task": round(calls / max(len(rows), 1), 3),
    }


def weighted(bench: Bench, name: str, each: int) -> dict[str, Any]:
    task, park_before = _begin(bench, name)
    for _ in range(each):
        task.delay("heavy")
        task.delay("light")
    rows = _collect(bench, name, 2 * each, _ideal_s(2 * each) * 3 + 60)
    calls = _limiter_calls(bench, park_before)
    ordered = [tenant for _, _, tenant in sorted(rows)]
    # both flood until one of them has less than a window's worth left to start
    left = {"heavy": each, "light": each}
    end = len(ordered)
    for i, tenant in enumerate(ordered):
        left[tenant] -= 1
        if min(left.values()) < RATE.limit:
            end = i + 1
            break
    both = ordered[RATE.limit : end]
    return {
        "task": name,
        "sent": 2 * each,
        "executed": len(rows),
        "heavy_share_while_both_wait": round(both.count("heavy") / max(len(both), 1), 3),
        "slots_counted": len(both),
        # tasks of the tenant that ran out first which started after that point: calls
        # moved to the back by a swap (see docs/timing.md, fair shares)
        "stragglers": sum(tenant == min(left, key=lambda t: left[t]) for tenant in ordered[end:]),
        "starts_over_limit": round(
            max_in_window([s for s, _, _ in rows], RATE.window_us) / RATE.limit, 2
        ),
        "calls_per_task": round(calls / max(len(rows), 1), 3),
    }


def run(quick: bool = False) -> dict[str, Any]:
    a_tasks, each = (100, 60) if quick else (200, 150)
    bench = Bench("redis", RATE, 0, 0)
    try:
        bench.nodes.start(bench.tasks.app)
        out: dict[str, Any] = {"rate": str(RATE), "a_tasks": a_tasks, "b_tasks": B_TASKS}
        out["neighbour"] = {
            "fair": neighbour(bench, "fair_tenant", a_tasks),
            "fifo": neighbour(bench, "fifo_tenant", a_tasks),
        }
        out["weighted"] = {
            "fair": weighted(bench, "fair_tenant", each),
            "fifo": weighted(bench, "fifo_tenant", each),
        }
    finally:
        bench.close()
    return out


def table(results: dict[str, Any]) -> list[str]:
    """The markdown table of docs/benchmarks.md, the fair-shares row."""
    rows = []
    for label, variant in (('fair_key="{tenant}"', "fair"), ("FIFO (no fair_key)", "fifo")):
        n = results["neighbour"][variant]
        w = results["weighted"][variant]
        rows.append(
            (
                label,
                f"{n['b_worst_wait_s']:.2f} s",
                f"{n['drain_utilization']:.2f}",
                f"{n['starts_over_limit']:.2f}",
                f"{n['calls_per_task']:.2f}",
                f"{w['heavy_share_while_both_wait']:.2f} ({w['stragglers']} late)",
                f"{w['calls_per_task']:.2f}",
            )
        )
    header = (
        f"{results['rate']}, 3 nodes; A {results['a_tasks']}, B {results['b_tasks']} "
        f"{B_AFTER:g} s later",
        "B's worst wait",
        "drain utilization",
        "starts / limit",
        "calls / task",
        "3:1 heavy share",
        "calls / task (3:1)",
    )
    return markdown(header, rows, right=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller backlogs")
    args = parser.parse_args()
    results = run(args.quick)
    print(json.dumps(results, indent=2))
    publish("fair.json", results, table(results), None if args.quick else "fair shares")


if __name__ == "__main__":
    main()
