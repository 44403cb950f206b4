"""The scaling curves of rows 10 and 11 as one PNG (matplotlib, from the ``bench`` extra).

``python -m benchmarks.curves`` draws ``benchmarks/results/scale.png`` from the figures
the last runs of ``bench_scale`` and ``bench_script_scale`` saved; the full run draws it
too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.output import RESULTS


def plot(scale: list[dict[str, Any]], script_scale: dict[str, Any], path: Path) -> bool:
    """Drain / ideal, calls and publishes per task and peak node memory against the
    backlog (per broker), and Redis time per call against the limit (per path); False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    drain, calls, memory, server = axes.flat
    for run in scale:
        drains = run["drains"]
        xs = [d["multiple"] for d in drains]
        broker = run["broker"] + ("" if run.get("parked", False) else ", not parked")
        drain.plot(xs, [d["drain_over_ideal"] for d in drains], marker="o", label=broker)
        calls.plot(xs, [d["calls_per_task"] for d in drains], marker="o", label=f"{broker}: calls")
        calls.plot(
            xs,
            [d["publishes_per_task"] for d in drains],
            marker="x",
            linestyle="--",
            label=f"{broker}: publishes",
        )
        memory.plot(
            [0, *xs],
            [max(run["idle_node_rss_mb"])] + [max(d["peak_node_rss_mb"]) for d in drains],
            marker="o",
            label=f"{broker}: node",
        )
        if "idle_consumer_rss_mb" in run:
            memory.plot(
                [0, *xs],
                [max(run["idle_consumer_rss_mb"])]
                + [max(d["peak_consumer_rss_mb"]) for d in drains],
                marker="x",
                linestyle="--",
                label=f"{broker}: consumer",
            )
    for ax, title, target in (
        (drain, "drain / ideal", 1.05),
        (calls, "per executed task", 2.0),
        (memory, "peak RSS, MB (0: idle): node, and its consumer", None),
    ):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("backlog / limit")
        if target is not None:
            ax.axhline(target, color="red", linestyle=":", label=f"target {target}")
        ax.legend(fontsize=7)
    for label, by_size in script_scale.items():
        sizes = [int(size) for size in by_size]
        for path_name in next(iter(by_size.values())):
            style = "-" if label == "weights all 1" else "--"
            server.plot(
                sizes,
                [by_size[str(size)][path_name] for size in sizes],
                linestyle=style,
                marker=".",
                label=f"{path_name} ({label})",
            )
    server.set_xscale("log")
    server.set_yscale("log")
    server.set_title("Redis µs per call, 10,000 reservations pending", fontsize=9)
    server.set_xlabel("limit (per 30 s)")
    server.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main() -> None:
    scale = json.loads((RESULTS / "scale.json").read_text())
    script_scale = json.loads((RESULTS / "script_scale.json").read_text())
    path = RESULTS / "scale.png"
    if plot(scale, script_scale, path):
        print(f"plot: {path}")
    else:
        raise SystemExit("matplotlib is not installed: pip install -e '.[bench]'")


if __name__ == "__main__":
    main()
