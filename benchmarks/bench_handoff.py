"""A freed concurrency slot goes to a waiting task at once: ``python -m
benchmarks.bench_handoff``.

Three ``celery worker`` nodes (prefork, concurrency 3) share ``Concurrency(2)``; the
bodies are uneven (0.1-2 s, seeded), as calls to an ERP or an LLM are. Two ways of
sending: all at once (a backlog), and one every ``--gap`` seconds (faster than two
slots drain them, so calls are always waiting). Deferred copies are parked
(``ratelimit_park_after=2``; "auto" parks when the limiter shares the broker's Redis).
The figures, by Redis time:

- utilization: the bodies' time / (2 x the span, first start to last end);
- idle while waiting: the slot-seconds a slot was free while some task was sent and
  not started, per task;
- the longest such gap: how long a slot stayed free while a task waited;
- the most bodies at once (the invariant: 2) and limiter calls per task (every script
  call and BLPOP on the limiter's Redis, the park's apart).

``--compare REF`` runs the same on the code of git ref ``REF`` too (a worktree of it),
for today's figure beside the new.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_celery import Bench
from benchmarks.bench_concurrency import CallKinds
from celery_ratelimit._engine.rate import Rate
from tests.measure import most_at_once

SLOTS = 2
COUNT = 24
GAP = 0.35


def bodies(seed: int, count: int) -> list[float]:
    rng = random.Random(seed)
    return [round(rng.uniform(0.1, 2.0), 3) for _ in range(count)]


def idle_while_waiting(sends: list[int], spans: list[tuple[int, int]]) -> tuple[float, float]:
    """Slot-seconds free while a task waited, and the longest stretch of it (seconds)."""
    events = sorted(
        [(t, "send") for t in sends]
        + [(s, "start") for s, _ in spans]
        + [(e, "end") for _, e in spans]
    )
    running = waiting = 0
    idle = longest = 0.0
    gap_from: int | None = None
    last = events[0][0]
    for at, kind in events:
        if running < SLOTS and waiting > 0:
            idle += (SLOTS - running) * (at - last) / 1e6
        last = at
        running += {"start": 1, "end": -1}.get(kind, 0)
        waiting += {"send": 1, "start": -1}.get(kind, 0)
        free = running < SLOTS and waiting > 0
        if free and gap_from is None:
            gap_from = at
        elif not free and gap_from is not None:
            longest = max(longest, (at - gap_from) / 1e6)
            gap_from = None
    return idle, longest


def drain(bench: Bench, times: list[float], gap: float) -> dict[str, Any]:
    client = bench.client
    client.delete("bench:spans", "bench:runs:uneven", "bench:holders")
    kinds = CallKinds(bench)
    sends = []
    for body in times:
        seconds, micros = client.time()
        sends.append(seconds * 1_000_000 + micros)
        bench.tasks.uneven.delay(body)
        if gap:
            time.sleep(gap)
    deadline = time.monotonic() + sum(times) + 60
    while client.llen("bench:spans") < len(times) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    by_kind = kinds.close()
    spans = [tuple(int(x) for x in raw.split()) for raw in client.lrange("bench:spans", 0, -1)]
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    busy = sum(e - s for s, e in spans)
    idle, longest = idle_while_waiting(sends, spans)  # type: ignore[arg-type]
    calls = sum(v for k, v in by_kind.items() if k != "park")
    return {
        "sent": len(times),
        "executed": len(spans),
        "utilization": round(busy / (SLOTS * (last - first)), 3),
        "idle_slot_s_per_task": round(idle / len(times), 3),
        "longest_idle_gap_s": round(longest, 3),
        "most_at_once": most_at_once(spans),  # type: ignore[arg-type]
        "calls_per_task": round(calls / max(len(spans), 1), 2),
        # its scripts and its movers' naps
        "park_calls_per_task": round(by_kind.get("park", 0) / len(spans), 2),
        "calls_by_kind": {k: round(v / len(spans), 2) for k, v in by_kind.items()},
        # the most slots Redis had held when a body started (the invariant, 2)
        "most_held": max(map(int, client.lrange("bench:holders", 0, -1)), default=0),
    }


def run(seed: int = 1, count: int = COUNT, gap: float = GAP) -> dict[str, Any]:
    bench = Bench("redis", Rate.parse("1/s"), 0, 0, concurrency=3, park_after="2")
    try:
        bench.nodes.start(bench.tasks.app)
        at_once = drain(bench, bodies(seed, count), 0.0)
        over_time = drain(bench, bodies(seed + 1, count), gap)
    finally:
        bench.close()
    return {"at_once": at_once, "over_time": over_time}


def on_ref(ref: str, args: list[str]) -> dict[str, Any]:
    """This benchmark run on the library of git ref ``ref`` (its tests and benchmarks
    are this checkout's)."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "ref"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "-q", "--detach", str(tree), ref],
            check=True,
        )
        try:
            for sub in ("benchmarks", "tests"):
                subprocess.run(["rm", "-rf", str(tree / sub)], check=True)
                subprocess.run(["cp", "-r", str(root / sub), str(tree / sub)], check=True)
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_handoff", "--json", *args],
                cwd=tree,
                env={**os.environ, "PYTHONPATH": str(tree)},
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=True
            )
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=COUNT, help="tasks a drain")
    parser.add_argument("--gap", type=float, default=GAP, help="seconds between sends")
    parser.add_argument("--compare", metavar="REF", help="also run on the code of git REF")
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args()
    same = ["--seed", str(args.seed), "--count", str(args.count), "--gap", str(args.gap)]
    results = {"this": run(args.seed, args.count, args.gap)}
    if args.compare:
        results[args.compare] = on_ref(args.compare, same)
    print(json.dumps(results if not args.json else results["this"]))


if __name__ == "__main__":
    main()
