"""A backlog behind a rate and a concurrency limit whose copies come back late:
``python -m benchmarks.bench_late_copies [--tasks N] [--late S ...] [--concurrency N]
[--horizon S]``.

``Limiter`` alone on a private redis-server, the calls a worker makes for each task
(``acquire`` with a reservation, ``confirm`` when its copy comes back, ``release`` at
the end of its body), in one process: ``Limit("2/s")`` and ``Concurrency(2)`` (or
``--concurrency 0``: the rate alone), bodies of 0.8 s, every task sent at once. A copy
comes back after its ``retry_after`` plus a delay drawn evenly from 0 to ``--late``
seconds (seeded): the broker's delay, seconds under faults. A task denied past
``--horizon`` seconds (no slot) comes back after the horizon at most, as the Celery
layer's ``ratelimit_max_countdown`` caps it. Prints, for each delay, the starts a second
from the first start to the last (the bound: 2) and the limiter calls per task (a
reservation and its start: 2).
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from typing import Any

from celery_ratelimit import Concurrency, Limit, Limiter
from celery_ratelimit._tools.embedded import RedisServer

BODY = 0.8
HOLD = 0.2


def drain(
    limiter: Limiter, tasks: int, late: float, seed: int, limits: list[Any], horizon: float
) -> dict[str, float]:
    """Send ``tasks`` at once and run them to the end; the drain's figures."""
    rng = random.Random(seed)
    key = f"late{late}-{len(limits)}"
    t0 = time.monotonic()
    # (due, order, what, task, token): a call to make, or a body's end
    events: list[tuple[float, int, str, int, str | None]] = [
        (0.0, i, "call", i, None) for i in range(tasks)
    ]
    order, calls, starts = tasks, 0, []
    while events:
        due, _, what, task, token = heapq.heappop(events)
        time.sleep(max(0.0, t0 + due - time.monotonic()))
        now = time.monotonic() - t0
        if what == "end":
            limiter.release(token or "", key, limits)
            continue
        calls += 1
        if token is None:
            decision = limiter.acquire(key, limits, reserve=True, hold=HOLD, horizon=horizon)
        else:
            decision = limiter.confirm(token, key, limits, hold=HOLD, horizon=horizon)
        if decision.allowed:
            begin = now + max(decision.retry_after, 0.0)
            starts.append(begin)
            event = (begin + BODY, order, "end", task, decision.token)
        else:
            wait = min(max(decision.retry_after, 0.0), horizon)
            back = now + wait + rng.uniform(0.0, late)
            event = (back, order, "call", task, decision.token if decision.reserved else None)
        heapq.heappush(events, event)
        order += 1
    span = max(starts) - min(starts)
    return {"starts_per_s": round((len(starts) - 1) / span, 2), "calls_per_task": calls / tasks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--late", type=float, nargs="+", default=[0.0, 1.0, 3.0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--horizon", type=float, default=600.0)
    args = parser.parse_args()
    limits: list[Any] = [Limit("2/s")]
    if args.concurrency:
        limits.append(Concurrency(args.concurrency, lease=10))
    with RedisServer() as server:
        limiter = Limiter(server.client(), prefix="bench-late")
        both = f" and Concurrency({args.concurrency})" if args.concurrency else ""
        print(f"{args.tasks} tasks at once, 2/s{both}, bodies {BODY} s, horizon {args.horizon:g} s")
        for late in args.late:
            out = drain(limiter, args.tasks, late, args.seed, limits, args.horizon)
            print(
                f"  copies 0-{late:g} s late: {out['starts_per_s']:.2f} starts/s (bound 2), "
                f"{out['calls_per_task']:.2f} calls a task"
            )


if __name__ == "__main__":
    main()
