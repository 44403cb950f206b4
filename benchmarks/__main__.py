"""All benchmarks in one process: ``python -m benchmarks [--quick]``.

Starts its own redis-servers (and uses the machine's RabbitMQ on 127.0.0.1:5672 when
there is one), runs the limiter micro-benchmarks, the three-node Celery scenarios and
the starts on every pool (``bench_pools``) and of a cold flood on the green pools
(``bench_flood``), backlogs of 10-100x the limit
(``bench_scale``) and each script path's Redis time against the limit's size
(``bench_script_scale``, both drawn as ``benchmarks/results/scale.png``), concurrency
limits and a 429 pause across nodes (``bench_concurrency``), even pacing beside
throttled-py's GCRA (``bench_pacing``),
prints one table of ratios measured in this run next to their targets, writes the raw
figures to ``benchmarks/results/all.json`` and, with matplotlib installed, draws
``benchmarks/results/celery.png`` (executions per window over time, limit as a line).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path
from typing import Any

from benchmarks import (
    bench_celery,
    bench_cluster,
    bench_concurrency,
    bench_flood,
    bench_limiter,
    bench_pacing,
    bench_pools,
    bench_scale,
    bench_script_scale,
    curves,
    docs_tables,
)
from benchmarks.docs_tables import markdown
from benchmarks.output import RESULTS, save
from celery_ratelimit._engine.rate import Rate
from celery_ratelimit._tools.embedded import RedisServer


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}"


def rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, measured, target, verdict) for the table."""
    out: list[tuple[str, str, str, str]] = []

    def add(name: str, value: float | None, target: str, ok: bool | None) -> None:
        shown = (
            "n/a" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)
        )
        out.append((name, shown, target, "" if ok is None else ("met" if ok else "MISSED")))

    a = results["limiter"]["a_client_side"]
    for name, row in a.items():
        if name != "ping":
            target = (
                "<= 1.10"
                if name.startswith("acquire (not")
                else "bound"
                if name.startswith("bound")
                else "anchor"
            )
            ok = row["x_ping"] <= 1.10 if target == "<= 1.10" else None
            add(f"1. decision time / PING: {name}", row["x_ping"], target, ok)
    b = results["limiter"]["b_server_side"]
    add(
        "2. server us/decision, cost 1",
        b["cost 1"]["usec_per_call"],
        "<= 8",
        b["cost 1"]["usec_per_call"] <= 8,
    )
    add(
        "2. server us, cost 1000 / cost 1",
        b["cost 1000 / cost 1"],
        "<= 1.2",
        b["cost 1000 / cost 1"] <= 1.2,
    )
    for floor in (
        "bound: EVALSHA of 'return 1'",
        "floor3: TIME+ZMSCORE+ZADD",
        "floor: TIME+ZMSCORE+ZREMRANGEBYSCORE+ZADD",
        "seed: TIME+ZREMRANGEBYSCORE+ZADD+PEXPIRE",
        "contract: seed + settings + running total",
    ):
        if floor in b:
            add(f"2. server us, {floor}", b[floor]["usec_per_call"], "bound", None)
    if "cost 1 / floor" in b:
        add("2. server us, cost 1 / the 4-command floor", b["cost 1 / floor"], "", None)
    if "cost 1 / seed" in b:
        ratio = b["cost 1 / seed"]
        add("2. server us, cost 1 / the seed algorithm's script", ratio, "<= 1.2", ratio <= 1.2)
    if "cost 1 / contract" in b:
        add("2. server us, cost 1 / the contract's bare script", b["cost 1 / contract"], "", None)
    for name in ("cost 100", "cost 1, 2 limits", "cost 1, 4 limits", "cost 1, rate overridden"):
        if name in b:
            add(f"2. server us/decision, {name}", b[name]["usec_per_call"], "", None)
    for name, row in results["limiter"]["c_memory"].items():
        if row.get("bound"):
            add(f"3. bound: {name} (bytes/entry)", row["bytes_per_entry"], "bound", None)
        elif "usec_per_decision" in row:
            add(
                f"3. bound: {name} (bytes/entry; server us/decision {row['usec_per_decision']})",
                row["bytes_per_entry"],
                "bound",
                None,
            )
        elif "bytes_per_entry" in row:
            per = row["bytes_per_entry"]
            add(f"3. memory bytes/entry, {name} ({row['encoding']})", per, "<= 60", per <= 60)
        else:
            add(f"3. memory bytes/key, {name}", row["bytes"], "O(1)", None)
    for name, row in results["limiter"]["d_throughput"].items():
        add(f"4. decisions/s, {name}", row["decisions_per_s"], "", None)
    for broker in ("redis", "rabbitmq"):
        c = results.get(f"celery_{broker}")
        if not c:
            continue
        tag = f"[{broker}]"
        add(
            f"5. most grants in a window / limit {tag}",
            c["reserved"]["grants_over_limit"],
            "1.00",
            c["reserved"]["grants_over_limit"] <= 1.0,
        )
        add(
            f"5. most starts in a window / limit {tag}",
            c["reserved"]["starts_over_limit"],
            "1.00",
            c["reserved"]["starts_over_limit"] <= 1.0,
        )
        add(
            f"5. anchor: Celery rate_limit, starts / limit {tag}",
            c["celery_rate_limit"]["starts_over_limit"],
            "anchor",
            None,
        )
        for mode in ("reserved", "unreserved"):
            r = c[mode]
            label = "on" if mode == "reserved" else "off"
            add(
                f"6. drain / ideal, reservations {label} {tag}",
                r["drain_over_ideal"],
                "<= 1.05",
                r["drain_over_ideal"] <= 1.05,
            )
            add(
                f"7. limiter calls / task, reservations {label} {tag}",
                r["calls_per_task"],
                "<= 2.0" if label == "on" else "",
                r["calls_per_task"] <= 2.0 if label == "on" else None,
            )
            add(
                f"7. broker publishes / task, reservations {label} {tag}",
                r["publishes_per_task"],
                "<= 2.0" if label == "on" else "",
                r["publishes_per_task"] <= 2.0 if label == "on" else None,
            )
        o = c["overhead"]
        add(
            f"8. tasks/s with a loose limit / without {tag}",
            o["ratio"],
            ">= 0.95",
            o["ratio"] >= 0.95,
        )
        for bound, what in (
            ("one_round_trip", "PING"),
            ("one_script_call", "EVALSHA of 'return 1'"),
            ("one_floor_call", "EVALSHA of the floor script"),
        ):
            if f"{bound}_ratio" in o:
                add(
                    f"8. bound: tasks/s with one more {what} per task / without {tag}",
                    o[f"{bound}_ratio"],
                    "bound",
                    None,
                )
        if "loose_over_floor" in o:
            add(
                f"8. tasks/s with a loose limit / with the floor script, by round {tag}",
                o["loose_over_floor"],
                "",
                None,
            )
        if "cpu_ratio" in o:
            for name, what in (
                ("loose", "8. CPU per task without / with a loose limit"),
                ("one_script_call", "8. bound: CPU per task without / with one more EVALSHA"),
                ("one_floor_call", "8. bound: CPU per task without / with one floor script"),
            ):
                add(f"{what} {tag}", o["cpu_ratio"][name], "", None)
    for r in results.get("pools", []):
        anchor = r["task"] == "unchecked"
        add(
            f"9. {'anchor, guard 0: ' if anchor else ''}most starts in a window / limit, "
            f"{r['pool']}{', busy core' if r['busy_core'] else ''} "
            f"(worst of {r['runs']} runs; {r['runs_within_limit']} at 1.00)",
            r["worst_starts_over_limit"],
            "anchor" if anchor else "1.00",
            None if anchor else r["worst_starts_over_limit"] <= 1.0,
        )
    for r in results.get("flood", []):
        what = f"{r['pool']}{', busy core' if r['busy_core'] else ''} (worst of {r['runs']} runs)"
        add(
            f"9b. cold flood, most starts in a window / limit by first line, {what}",
            r["worst_lines_over_limit"],
            "1.00",
            r["worst_lines_over_limit"] <= 1.0,
        )
        add(
            f"9b. cold flood, most first I/Os in a window / limit, {what}",
            r["worst_ios_over_limit"],
            "<= 1.1",
            r["worst_ios_over_limit"] <= 1.1,
        )
    for r in results.get("scale", []):
        parked = r.get("parked", False)
        for d in r["drains"]:
            tag = f"{d['multiple']}x the limit [{r['broker']}{'' if parked else ', not parked'}]"
            grown = max(d["peak_node_rss_mb"]) - max(r["idle_node_rss_mb"])
            held = max(d["peak_consumer_rss_mb"]) - max(r["idle_consumer_rss_mb"])
            if not parked:
                add(f"10. anchor: node memory above idle, MB, backlog {tag}", grown, "anchor", None)
                add(f"10. anchor: consumer memory above idle, MB, {tag}", held, "anchor", None)
                continue
            add(f"10. consumer memory above idle, MB, backlog {tag}", held, "bounded", None)
            add(
                f"10. drain / ideal, backlog {tag}",
                d["drain_over_ideal"],
                "<= 1.05",
                d["drain_over_ideal"] <= 1.05,
            )
            for what in ("calls", "publishes"):
                value = d[f"{what}_per_task"]
                add(f"10. limiter {what} / task, backlog {tag}", value, "<= 2.0", value <= 2.0)
            add(f"10. node memory above idle, MB, backlog {tag}", grown, "bounded", None)
    for label, by_size in results.get("script_scale", {}).items():
        for path in by_size["100"]:
            ratio = round(by_size["100000"][path] / max(by_size["100"][path], 0.1), 2)
            add(
                f"11. server us per call, limit 100,000 / limit 100: {path} [{label}]",
                ratio,
                "<= 2.0",
                ratio <= 2.0,
            )
    slots = results.get("concurrency", {}).get("slots")
    if slots:
        for tag in ("cold", "warm"):
            d = slots[tag]
            what = "first drain" if tag == "cold" else "average learnt"
            add(f"12. busy-slot utilization, Concurrency(2), {what}", d["utilization"], ">= 0.9",
                d["utilization"] >= 0.9)  # fmt: skip
            add(f"12. most slots held (Redis) / 2, {what}", d["most_held"] / 2, "1.00",
                d["most_held"] <= 2)  # fmt: skip
            add(f"12. limiter calls / task (release included), {what}", d["calls_per_task"],
                "<= 3.0", d["calls_per_task"] <= 3.0)  # fmt: skip
        add("12. anchor: busy-slot utilization, one node -c 2",
            slots["anchor_one_node"]["utilization"], "anchor", None)  # fmt: skip
    pacing = results.get("pacing")
    if pacing:
        for name, label in bench_pacing.SCENARIOS:
            d = pacing["nodes"][name]
            add(f"13. most starts in 100 ms, {label}", d["most_in_interval"],
                "<= 3" if name == "paced" else "anchor",
                d["most_in_interval"] <= 3 if name == "paced" else None)  # fmt: skip
            add(f"13. most starts in 2 s, {label}", d["most_in_window"],
                "<= 20" if name == "paced" else "anchor",
                d["most_in_window"] <= 20 if name == "paced" else None)  # fmt: skip
            add(f"13. drain span / (59 x 100 ms), {label}", d["span_over_paced"],
                "<= 1.1" if name == "paced" else "anchor",
                d["span_over_paced"] <= 1.1 if name == "paced" else None)  # fmt: skip
        ratio = pacing["server"]["paced / unpaced"]
        add("13. server us per decision, paced / unpaced", ratio, "<= 1.15", ratio <= 1.15)
    pause = results.get("concurrency", {}).get("pause")
    if pause:
        inside = pause["starts_inside_pause"]
        add("12. bodies started inside a 2 s 429 pause (3 nodes)", inside, "0", inside == 0)
    return out


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from celery_ratelimit._tools.demo import windows_over_time

    scenarios = [
        (broker, name)
        for broker in ("redis", "rabbitmq")
        if results.get(f"celery_{broker}")
        for name in ("reserved", "unreserved", "celery_rate_limit")
    ]
    fig, axes = plt.subplots(len(scenarios), 1, figsize=(9, 2.4 * len(scenarios)), sharex=True)
    for ax, (broker, name) in zip(list(getattr(axes, "flat", [axes])), scenarios, strict=False):
        c = results[f"celery_{broker}"]
        rate = Rate.parse(c["rate"])
        xs, ys = windows_over_time(c[name]["starts_us"], rate.window_us)
        ax.plot(xs, ys, label="task starts in the trailing window")
        ax.axhline(rate.limit, color="red", linestyle="--", label=f"limit {rate}")
        ax.set_title(f"{name} ({broker} broker, 3 nodes)", fontsize=9)
        ax.set_ylabel("per window")
        ax.legend(loc="upper right", fontsize=7)
    axes_list = list(getattr(axes, "flat", [axes]))
    axes_list[-1].set_xlabel("seconds since the first start")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a smaller backlog")
    parser.add_argument(
        "--skip",
        default="",
        help="sections to leave out, comma-separated: pools, flood, scale, script-scale, "
        "concurrency, cluster, pacing",
    )
    args = parser.parse_args()
    skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    known = {"pools", "flood", "scale", "script-scale", "concurrency", "cluster", "pacing"}
    unknown = skip - known
    if unknown:
        parser.error(f"unknown sections to skip: {', '.join(sorted(unknown))}")
    started = time.monotonic()
    rounds, calls = (3, 1000) if args.quick else (9, 2000)
    results: dict[str, Any] = {"machine": machine()}
    sections: dict[str, float] = {}

    def timed(name: str, run: Any, *args: Any) -> Any:
        begun = time.monotonic()
        try:
            return run(*args)
        finally:
            sections[name] = round(time.monotonic() - begun, 1)
            # what is measured so far, kept should a later section fail
            save("partial.json", {**results, "section_seconds": sections})

    server = RedisServer()
    try:
        results["limiter"] = {
            "redis_version": server.client().info("server")["redis_version"],
            "a_client_side": timed("1", bench_limiter.client_side, server, rounds, calls),
            "b_server_side": timed("2", bench_limiter.server_side, server, rounds, calls),
            "c_memory": timed("3", bench_limiter.memory, server),
            "d_throughput": timed(
                "4", bench_limiter.throughput, server, 1.0 if args.quick else 2.0
            ),
        }
    finally:
        server.close()
    backlog, overhead = (200, 300) if args.quick else (400, 2000)
    results["celery_redis"] = timed(
        "celery redis", bench_celery.run, "redis", "20/s", backlog, overhead
    )
    if bench_celery.rabbitmq_reachable():
        results["celery_rabbitmq"] = timed(
            "celery rabbitmq", bench_celery.run, "rabbitmq", "20/s", backlog, overhead
        )
    if "pools" not in skip:
        results["pools"] = timed("pools", bench_pools.run, 3 if args.quick else 20)
    if "flood" not in skip:
        results["flood"] = timed("flood", bench_flood.run, 3 if args.quick else 20)
    if "scale" not in skip:
        results["scale"] = timed("scale", bench_scale.run_all)
    if "script-scale" not in skip:
        results["script_scale"] = timed("script scale", bench_script_scale.run)
    if "concurrency" not in skip:
        results["concurrency"] = timed("concurrency", bench_concurrency.run_all)
    if "cluster" not in skip:
        results["cluster"] = timed("cluster", bench_cluster.run)
    if "pacing" not in skip:
        results["pacing"] = timed("pacing", bench_pacing.run, args.quick)
    results["seconds"] = round(time.monotonic() - started, 1)
    results["section_seconds"] = sections
    table = rows(results)
    width = max(len(r[0]) for r in table)
    print(f"\n{results['machine']}, Redis {results['limiter']['redis_version']}")
    print(f"{'figure':{width}}  {'measured':>9}  {'target':>8}")
    for name, value, target, verdict in table:
        print(f"{name:{width}}  {value:>9}  {target:>8}  {verdict}")
    save("all.json", results)
    shown = [(n, v, f"{t} ({verdict})" if verdict else t) for n, v, t, verdict in table]
    docs_tables.write(
        "all rows",
        [
            f"{results['machine']}, Redis {results['limiter']['redis_version']}, "
            f"{results['seconds']:.0f} s"
            + (f" (rows of {', '.join(sorted(skip))} not run: see their sections)" if skip else "")
            + ":",
            "",
            *markdown(("figure", "measured", "target"), shown),
        ],
    )
    if "scale" in results:
        docs_tables.write("row 10", bench_scale.table(results["scale"]))
    if "concurrency" in results:
        docs_tables.write("row 12", bench_concurrency.table(results["concurrency"]))
    if "cluster" in results:
        docs_tables.write("scaling out", bench_cluster.table(results["cluster"]))
    if "pacing" in results:
        docs_tables.write("row 13", bench_pacing.table(results["pacing"]))
    if plot(results, RESULTS / "celery.png"):
        print(f"plot: {RESULTS / 'celery.png'}")
    if {"scale", "script_scale"} <= results.keys() and curves.plot(
        results["scale"], results["script_scale"], RESULTS / "scale.png"
    ):
        print(f"plot: {RESULTS / 'scale.png'}")
    parts = ", ".join(f"{name} {secs}s" for name, secs in sections.items())
    print(f"raw figures: {RESULTS / 'all.json'} ({results['seconds']}s in all: {parts})")


if __name__ == "__main__":
    main()
