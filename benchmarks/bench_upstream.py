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

Figures: the share of the upstream's answers that were 429, successful calls per
second (accepted calls over the span from the first to the last one) / the upstream's
limit, and, for adapt, how long after the first call the last 429 came.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks.bench_celery import RESULTS, Bench
from benchmarks.docs_tables import markdown
from celery_ratelimit._rate import Rate
from tests.upstream import Upstream

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
    return {
        "mode": mode if mode != "observe" else f"observe ({path.split('-')[0]})",
        "tasks": tasks,
        "accepted": len(ok),
        "answered_429": len(rejected),
        "share_429": len(rejected) / len(mine) if mine else float("nan"),
        "ok_per_s": (len(ok) - 1) / span if len(ok) > 1 else float("nan"),
        "ok_per_s_of_limit": (len(ok) - 1) / span / upstream.limit if len(ok) > 1 else 0.0,
        "last_429_after_s": rejected[-1] - mine[0].at if rejected else 0.0,
    }


def run_all(limit: int = 20, tasks: int = 300, adapt_tasks: int = 300) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with Upstream(limit, 1.0) as upstream:
        bench = Bench("redis", Rate.parse(f"{limit}/s"), 0, 0)
        bench.nodes.env["CRL_BENCH_UPSTREAM"] = upstream.url("").rstrip("/")
        bench.nodes.env["CRL_BENCH_DECLARED"] = f"{2 * limit}/s"
        try:
            bench.nodes.start(bench.tasks.app)
            for mode, path in MODES:
                count = adapt_tasks if mode == "adapt" else tasks
                rows.append(drain(bench, upstream, mode, path, count))
        finally:
            bench.close()
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    return markdown(
        ("way", "tasks", "429 share", "successful calls/s / limit", "last 429 after"),
        [
            (
                r["mode"],
                r["tasks"],
                f"{r['share_429']:.1%}",
                f"{r['ok_per_s_of_limit']:.2f} ({r['ok_per_s']:.1f}/s)",
                f"{r['last_429_after_s']:.1f} s",
            )
            for r in rows
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=20, help="the upstream's calls a second")
    parser.add_argument("--tasks", type=int, default=300, help="tasks per way")
    parser.add_argument(
        "--adapt-tasks", type=int, default=300, help="tasks of the adapt way (1200: about 60 s)"
    )
    args = parser.parse_args()
    rows = run_all(args.limit, args.tasks, args.adapt_tasks)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "upstream.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
