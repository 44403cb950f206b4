"""Concurrency limits across nodes: ``python -m benchmarks.bench_concurrency``.

Three ``celery worker`` nodes (prefork, concurrency 3) drain a backlog of tasks whose
bodies hold a slot of ``Concurrency(2)`` for 0.2 s each (``--body``, ``--backlog``), sent
at once, twice: first on a new key (no body has ended yet: the limit guesses a body's
time), then again (it has learnt the average). Each drain's figures: busy-slot
utilization (the bodies' time / (2 x the drain's span, first start to last end)), the
most bodies running at once (by each process's clock moved to Redis time: tens of ms of
offset between processes, measured apart, can show one or two more than the limit had)
and the most slots Redis held when a body started (the invariant, 2), limiter calls per
task (every script call and ``BLPOP`` on the limiter's Redis, read from MONITOR, the
park's left out: the release and lease renewals included; 3 is the ideal: a decision,
learning the turn, the release) with their kinds,
drain / ideal (the backlog's bodies back to back on 2 slots). The anchor: the same bodies
on one node of concurrency 2 with no limit, the usual way to cap concurrency (one
dedicated worker) without sharing it.

The pause row: one task's body is answered 429 with Retry-After 2 s; 60 more tasks of
the key are sent once the pause is written; how many bodies start inside the pause
(0 is the invariant), and how long after its end the first one starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from collections import Counter
from typing import Any

from benchmarks.bench_celery import Bench
from benchmarks.docs_tables import markdown
from benchmarks.output import save
from celery_ratelimit._celery.park import park_calls
from celery_ratelimit._engine.rate import Rate
from celery_ratelimit._engine.scripts import NAMES, source
from tests.measure import most_at_once

BODY = 0.2
SLOTS = 2
BACKLOG = 60


class CallKinds:
    """The limiter's Redis calls by kind (the entry script an EVALSHA runs, or the
    command), read from MONITOR on the limiter's own server while a drain runs."""

    def __init__(self, bench: Bench) -> None:
        self.scripts = {hashlib.sha1(source(n).encode()).hexdigest(): n for n in NAMES}
        self.counts: Counter[str] = Counter()
        self.monitor = bench.limiter_redis.client(decode_responses=True).monitor()
        self.monitor.__enter__()
        self.thread = threading.Thread(target=self.listen, daemon=True)
        self.thread.start()

    def listen(self) -> None:
        try:
            for event in self.monitor.listen():
                words = event.get("command", "").split()
                if not words or event.get("client_type") == "lua":  # a script's own
                    continue
                verb = words[0].upper()
                if verb == "EVALSHA" and len(words) > 1:
                    self.counts[self.scripts.get(words[1], "other script")] += 1
                elif verb in ("BLPOP", "LPOP"):
                    # a mover's nap, woken by a copy called in, is the park's
                    key = words[1].strip('"') if len(words) > 1 else ""
                    park = ":{park:" in key and key.endswith(":wake")
                    self.counts["park" if park else verb.lower()] += 1
        except Exception:  # the monitor closed
            return

    def close(self) -> dict[str, int]:
        time.sleep(0.2)
        self.monitor.connection.disconnect()
        return dict(self.counts)


def drain(bench: Bench, name: str, count: int, slots: int) -> dict[str, Any]:
    client = bench.client
    client.delete("bench:spans", f"bench:runs:{name}", "bench:holders")
    client.config_resetstat()
    kinds = CallKinds(bench)
    park_before = park_calls(client, "bench")
    task = getattr(bench.tasks, name)
    for _ in range(count):
        task.delay()
    deadline = time.monotonic() + count * BODY * 4 + 60
    while client.llen("bench:spans") < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    spans = [tuple(int(x) for x in raw.split()) for raw in client.lrange("bench:spans", 0, -1)]
    by_kind = kinds.close()
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    evalsha = int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))
    decisions = evalsha - (park_calls(client, "bench") - park_before) - len(spans)
    first = min(s for s, _ in spans)
    last = max(e for _, e in spans)
    busy = sum(e - s for s, e in spans)
    ideal = count * BODY / slots
    return {
        "executed": len(spans),
        "utilization": round(busy / (slots * (last - first)), 3),
        "most_at_once": most_at_once(spans),  # type: ignore[arg-type]
        # the most slots Redis had held when a body started (the anchor holds none)
        "most_held": max(map(int, client.lrange("bench:holders", 0, -1)), default=0),
        "decisions_per_task": round(decisions / max(len(spans), 1), 3),
        # every limiter call (the park's left out) per task, the release included
        "calls_per_task": round(
            sum(v for k, v in by_kind.items() if k != "park") / max(len(spans), 1), 3
        ),
        "calls_by_kind": {k: round(v / max(len(spans), 1), 3) for k, v in by_kind.items()},
        "drain_over_ideal": round((last - first) / 1e6 / ideal, 3),
    }


def run_slots(broker: str = "redis") -> dict[str, Any]:
    bench = Bench(broker, Rate.parse("1/s"), 0, 0, concurrency=3)
    bench.nodes.env["CRL_BENCH_BODY"] = str(BODY)
    try:
        bench.nodes.start(bench.tasks.app)
        cold = drain(bench, "slotted", BACKLOG, SLOTS)
        warm = drain(bench, "slotted", BACKLOG, SLOTS)
    finally:
        bench.close()
    anchor = Bench(broker, Rate.parse("1/s"), 0, 0, concurrency=SLOTS)
    anchor.nodes.count = 1
    anchor.nodes.env["CRL_BENCH_BODY"] = str(BODY)
    try:
        anchor.nodes.start(anchor.tasks.app)
        one_node = drain(anchor, "plain_body", BACKLOG, SLOTS)
    finally:
        anchor.close()
    return {"broker": broker, "cold": cold, "warm": warm, "anchor_one_node": one_node}


def run_pause(broker: str = "redis", pause: float = 2.0, count: int = 60) -> dict[str, Any]:
    bench = Bench(broker, Rate.parse("1/s"), 0, 0)
    client = bench.client
    try:
        bench.nodes.start(bench.tasks.app)
        bench.tasks.upstream.delay(pause)
        settings = "bench:{upstream}:settings"
        deadline = time.monotonic() + 30
        while not client.hget(settings, "pause") and time.monotonic() < deadline:
            time.sleep(0.005)
        until = int(float(client.hget(settings, "pause") or 0))
        raised = int(client.get("bench:429") or 0)
        for _ in range(count):
            bench.tasks.upstream.delay()
        deadline = time.monotonic() + 60
        while client.llen("bench:runs:upstream") < count + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        starts = [int(raw.split()[0]) for raw in client.lrange("bench:runs:upstream", 0, -1)]
    finally:
        bench.close()
    later = sorted(s for s in starts if s > raised)
    return {
        "broker": broker,
        "pause_s": pause,
        "executed": len(starts),
        "sent": count + 1,
        "starts_inside_pause": sum(raised < s < until for s in starts),
        "first_start_after_pause_ms": round((later[0] - until) / 1000, 1) if later else None,
    }


def run_all() -> dict[str, Any]:
    return {"slots": run_slots(), "pause": run_pause()}


def kinds(by_kind: dict[str, float]) -> str:
    """Calls per task by kind, largest first: ``acquire 1.00, blpop 0.97, ...``."""
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))


def table(results: dict[str, Any]) -> list[str]:
    """The markdown table of docs/benchmarks.md, row 12."""
    s = results["slots"]
    rows = []
    for label, d in (
        ("Concurrency(2), first drain on a new key", s["cold"]),
        ("Concurrency(2), the average learnt", s["warm"]),
        ("anchor: one node -c 2, no limit", s["anchor_one_node"]),
    ):
        rows.append(
            (
                label,
                f"{d['utilization']:.2f}",
                f"{d['most_at_once']} ({d['most_held']})" if "anchor" not in label else "-",
                f"{d['calls_per_task']:.2f}" if "anchor" not in label else "-",
                kinds(d["calls_by_kind"]) if "anchor" not in label else "-",
                f"{d['drain_over_ideal']:.2f}",
            )
        )
    header = (
        f"{BACKLOG} bodies of {BODY:g} s, 3 nodes",
        "busy-slot utilization",
        "most at once (held in Redis)",
        "limiter calls / task",
        "by kind",
        "drain / ideal",
    )
    lines = markdown(header, rows, right=1)
    p = results["pause"]
    lines += [
        "",
        f"A 429 with Retry-After {p['pause_s']:g} s, then {p['sent'] - 1} tasks of the key: "
        f"{p['starts_inside_pause']} bodies started inside the pause; the first after it "
        f"{p['first_start_after_pause_ms']} ms after its end; {p['executed']} executions "
        f"for {p['sent']} tasks (the one answered 429 runs twice).",
    ]
    return lines


def main() -> None:
    global BODY, BACKLOG
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--body", type=float, default=BODY, help="a body's seconds")
    parser.add_argument("--backlog", type=int, default=BACKLOG, help="tasks a drain")
    parser.add_argument(
        "--slots-only", action="store_true", help="the drains alone (no pause row, no file)"
    )
    args = parser.parse_args()
    BODY, BACKLOG = args.body, args.backlog
    if args.slots_only:
        print(json.dumps(run_slots(), indent=2))
        return
    results = run_all()
    save("concurrency.json", results, indent=2)
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
