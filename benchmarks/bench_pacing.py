"""Even pacing across nodes: ``python -m benchmarks.bench_pacing [--quick]``.

Three ``celery worker`` nodes (prefork, concurrency 2) drain 60 tasks sent at once, at
``20/2s``:

- ``Limit("20/2s", burst=2)``: ours, paced (GCRA beside the window, reserved slots paced);
- ``Limit("20/2s")``: ours, the window alone (the whole limit may start at once);
- throttled-py's GCRA (``per_duration(2 s, 20, burst=2)``) in the body, a denied call
  retried with Celery's ``self.retry(countdown=retry_after)``: how a limiter library is
  used from Celery.

Each drain's figures: the most body starts in any 100 ms (the emission interval; the
target is burst + 1), in any 2 s (the limit), the drain span (first start to last) over
59 x 100 ms (the span of a perfect pace after the first), and limiter script calls per
task (EVALSHA on the limiter's Redis, the park's own calls left out).

Then the server time of a decision (``usec_per_call`` of EVALSHA) with a paced limit
against the same limit unpaced, in interleaved rounds on one redis-server (each first
in every other round), as the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.bench_app import PACED_BURST, PACED_RATE
from benchmarks.bench_celery import Bench
from benchmarks.docs_tables import markdown
from benchmarks.output import publish
from celery_ratelimit import Limit, Limiter
from celery_ratelimit._celery.park import park_calls
from celery_ratelimit._engine.rate import Rate
from celery_ratelimit._tools.embedded import RedisServer
from tests.measure import max_in_window

TASKS = 60
PACED = Rate.parse(PACED_RATE)
#: The window of the tasks' limit, and the interval pacing keeps between starts.
WINDOW_US = PACED.window_us
INTERVAL_US = WINDOW_US // PACED.limit
SCENARIOS = (
    ("paced", f"ours, Limit({PACED_RATE!r}, burst={PACED_BURST})"),
    ("windowed", f"ours, Limit({PACED_RATE!r}), no pace"),
    ("throttled_gcra", f"throttled-py GCRA, burst {PACED_BURST}, self.retry"),
)


def drain(bench: Bench, name: str) -> dict[str, Any]:
    client = bench.client
    runs_key = f"bench:runs:{name}"
    client.delete(runs_key)
    client.config_resetstat()
    park_before = park_calls(client, "bench")
    task = getattr(bench.tasks, name)
    for _ in range(TASKS):
        task.delay()
    deadline = time.monotonic() + 90
    while client.llen(runs_key) < TASKS and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a duplicate, if any, shows up
    starts = sorted(int(raw.split()[0]) for raw in client.lrange(runs_key, 0, -1))
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    calls = int(stats.get("calls", 0)) - (park_calls(client, "bench") - park_before)
    span = (starts[-1] - starts[0]) if starts else 0
    return {
        "executed": len(starts),
        "most_in_interval": max_in_window(starts, INTERVAL_US),
        "most_in_window": max_in_window(starts, WINDOW_US),
        "span_over_paced": round(span / ((TASKS - 1) * INTERVAL_US), 3),
        "calls_per_task": round(calls / max(len(starts), 1), 2),
        "starts_us": starts,
    }


def run_nodes(broker: str = "redis") -> dict[str, Any]:
    # (the rate the other tasks of the app read: Celery's own rate_limit takes no "/2s")
    bench = Bench(broker, Rate.parse("10/s"), 0, 0)
    try:
        bench.nodes.start(bench.tasks.app)
        return {name: drain(bench, name) for name, _ in SCENARIOS}
    finally:
        bench.close()


def server_us(rounds: int, calls: int) -> dict[str, float]:
    """Median server µs per decision, paced and not, the pace never binding (a burst of
    the whole limit, far above the load), in interleaved rounds, each case first in
    every other round."""
    cases = {
        "unpaced": Limit("1000000000/200ms"),
        "paced": Limit("1000000000/200ms", burst=1_000_000_000),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    with RedisServer() as server:
        client = server.client()
        limiter = Limiter(client, prefix="bench-pace")
        for name, limit in cases.items():  # fill the window once
            deadline = time.monotonic() + 0.6
            while time.monotonic() < deadline:
                limiter.acquire(name, limit)
        for i in range(rounds):
            # the order alternates: the second of two identical cases measures a few %
            # slower in a round (an A/A run on this VM)
            for name, limit in list(cases.items())[:: 1 if i % 2 == 0 else -1]:
                client.config_resetstat()
                for _ in range(calls):
                    if not limiter.acquire(name, limit).allowed:
                        raise RuntimeError(f"{name}: the benchmark limit bound")
                stats = client.info("commandstats")["cmdstat_evalsha"]
                samples[name].append(float(stats["usec_per_call"]))
        client.close()
    out = {name: round(statistics.median(values), 2) for name, values in samples.items()}
    # each round's ratio (the two cases measured back to back), the median of them
    ratios = [p / u for p, u in zip(samples["paced"], samples["unpaced"], strict=True)]
    out["paced / unpaced"] = round(statistics.median(ratios), 3)
    out["spread paced / unpaced"] = [round(min(ratios), 3), round(max(ratios), 3)]  # type: ignore[assignment]
    return out


def run(quick: bool = False) -> dict[str, Any]:
    rounds, calls = (4, 1000) if quick else (12, 2000)
    return {"nodes": run_nodes(), "server": server_us(rounds, calls)}


def table(results: dict[str, Any]) -> list[str]:
    """The markdown table of docs/benchmarks.md, "pacing"."""
    rows = []
    for name, label in SCENARIOS:
        d = results["nodes"][name]
        rows.append(
            (
                label,
                f"{d['executed']}/{TASKS}",
                str(d["most_in_interval"]),
                str(d["most_in_window"]),
                f"{d['span_over_paced']:.2f}",
                f"{d['calls_per_task']:.2f}",
            )
        )
    header = (
        f"{TASKS} tasks at {PACED_RATE}, 3 nodes",
        "ran",
        "most starts in 100 ms (target 3)",
        "most in 2 s (limit 20)",
        "span / (59 x 100 ms)",
        "script calls / task",
    )
    s = results["server"]
    low, high = s["spread paced / unpaced"]
    return [
        *markdown(header, rows),
        "",
        f"Server time per decision (EVALSHA usec_per_call, medians of interleaved rounds): "
        f"paced {s['paced']} µs, unpaced {s['unpaced']} µs; paced / unpaced, the median "
        f"of the rounds' ratios, {s['paced / unpaced']}x (rounds from {low}x to {high}x; "
        "target <= 1.15x).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds of server time")
    args = parser.parse_args()
    results = run(args.quick)
    publish("pacing.json", results, table(results), "row 13")


if __name__ == "__main__":
    main()
