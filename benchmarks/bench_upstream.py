"""Limits that follow the upstream: ``python -m benchmarks.bench_upstream``.

A real HTTP upstream (``tests/upstream.py``: a threaded server on 127.0.0.1 allowing
``--limit`` calls in any second, answering 429 with a ``Retry-After`` over it) and three
``celery worker`` nodes (prefork, concurrency 2) running tasks declared at twice its
limit, as when a provider lowers a plan. Three ways, one after the other in the same
run, each on a key and an upstream window of its own:

- pause: the bodies read no headers; a 429 raises ``UpstreamRateLimited`` (a pause);
- observe: every answer's headers go to ``observe()``, and a 429 as above; once per
  family: ``x-ratelimit-*-requests`` (a reset in milliseconds), IETF ``RateLimit``
  (whole seconds), ``X-RateLimit-*`` (an epoch second);
- adapt: no headers; ``Limit(adapt=True)``, a 429 as above.

Figures: the share of the upstream's answers that were 429; successful calls per
second / the upstream's limit (the accepted calls past the first window's, which the
upstream takes at once, over the span from the first accepted call to the last); how
long after the first call the last 429 came; and when the way settled: from then on,
every 5 s (sliding by a second) had at least 0.8 of the limit accepted ("-": never).
The adapt way runs a backlog of 60 s at the upstream's limit (``--quick``: 20 s, and
200 tasks a way instead of 300).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from benchmarks.bench_celery import Bench
from benchmarks.docs_tables import markdown
from benchmarks.output import save
from celery_ratelimit._engine.rate import Rate
from tests.upstream import Upstream

#: Converged: the accepted calls in every SETTLE_SPAN s from then on are at least this
#: share of the upstream's limit.
SETTLED = 0.8
SETTLE_SPAN = 5

MODES = (
    ("pause", "none-pause"),
    ("observe", "llm-observe"),
    ("observe", "ietf-observe"),
    ("observe", "x-observe"),
    ("adapt", "none-adapt"),
)


def drain(bench: Bench, upstream: Upstream, mode: str, path: str, tasks: int) -> dict[str, Any]:
    task = getattr(bench.tasks, f"upstream_{mode}")
    for _ in range(tasks):
        task.delay(path)
    deadline = time.monotonic() + tasks / upstream.limit * 4 + 60
    while time.monotonic() < deadline:
        done = sum(1 for a in list(upstream.arrivals) if a.family == path and a.status == 200)
        if done >= tasks:
            break
        time.sleep(0.2)
    mine = [a for a in list(upstream.arrivals) if a.family == path]
    ok = sorted(a.at for a in mine if a.status == 200)
    rejected = sorted(a.at for a in mine if a.status == 429)
    span = ok[-1] - ok[0] if len(ok) > 1 else float("nan")
    # the upstream takes its whole limit at once in the first window, then at most its
    # limit a window: the calls past the first window's, over the span
    rate = (len(ok) - upstream.limit) / span if len(ok) > upstream.limit else float("nan")
    return {
        "mode": mode if mode != "observe" else f"observe ({path.split('-')[0]})",
        "tasks": tasks,
        "accepted": len(ok),
        "answered_429": len(rejected),
        "share_429": len(rejected) / len(mine) if mine else float("nan"),
        "ok_per_s": rate,
        "ok_per_s_of_limit": rate * upstream.window / upstream.limit,
        "settled_after_s": settled(ok, mine[0].at, upstream.limit / upstream.window),
        "last_429_after_s": rejected[-1] - mine[0].at if rejected else 0.0,
    }


def settled(ok: list[float], first: float, limit: float, span: int = SETTLE_SPAN) -> float:
    """Seconds from ``first`` after which every ``span`` s (sliding by a second, to the
    last accepted call) has at least :data:`SETTLED` of ``limit`` calls a second
    accepted; nan if none does."""
    end = ok[-1] if ok else first
    start = first
    while start + span <= end:
        if all(
            sum(1 for t in ok if at <= t < at + span) >= SETTLED * limit * span
            for at in _steps(start, end - span)
        ):
            return start - first
        start += 1.0
    return float("nan")


def _steps(start: float, last: float) -> list[float]:
    return [start + i for i in range(int(last - start) + 1)]


def run_all(
    limit: int = 20, tasks: int = 300, adapt_tasks: int = 300, ways: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with Upstream(limit, 1.0) as upstream:
        bench = Bench("redis", Rate.parse(f"{limit}/s"), 0, 0)
        bench.nodes.env["CRL_BENCH_UPSTREAM"] = upstream.url("").rstrip("/")
        bench.nodes.env["CRL_BENCH_DECLARED"] = f"{2 * limit}/s"
        try:
            bench.nodes.start(bench.tasks.app)
            for mode, path in MODES:
                if ways and path not in ways:
                    continue
                count = adapt_tasks if mode == "adapt" else tasks
                rows.append(drain(bench, upstream, mode, path, count))
        finally:
            bench.close()
        arrivals = [(a.at, a.family, a.status) for a in upstream.arrivals]
        save("upstream_arrivals.json", arrivals, indent=None)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    return markdown(
        (
            "way",
            "tasks",
            "429 share",
            "successful calls/s / limit",
            "last 429 after",
            "settled after",
        ),
        [
            (
                r["mode"],
                r["tasks"],
                f"{r['share_429']:.1%}",
                f"{r['ok_per_s_of_limit']:.2f} ({r['ok_per_s']:.1f}/s)",
                f"{r['last_429_after_s']:.1f} s" if r["answered_429"] else "-",
                "-" if math.isnan(r["settled_after_s"]) else f"{r['settled_after_s']:.0f} s",
            )
            for r in rows
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=20, help="the upstream's calls a second")
    parser.add_argument("--tasks", type=int, help="tasks per way (300; --quick: 200)")
    parser.add_argument(
        "--adapt-tasks", type=int, help="tasks of the adapt way (60 s at the limit; --quick: 20 s)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer tasks, a 20 s adapt way")
    parser.add_argument(
        "--ways", default="", help="comma-separated upstream paths to run (default: all)"
    )
    args = parser.parse_args()
    ways = tuple(w for w in args.ways.split(",") if w)
    tasks = args.tasks or (200 if args.quick else 300)
    adapt_tasks = args.adapt_tasks or args.limit * (20 if args.quick else 60)
    rows = run_all(args.limit, tasks, adapt_tasks, ways)
    save("upstream.json", rows, indent=2)
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
