"""Send a burst of the project's tasks and report the busiest window of each budget."""

from __future__ import annotations

import bisect
import sys

import redis

from examples.existing_project.celery import REDIS_URL, RUNS
from examples.existing_project.tasks import cleanup, send_email, sync_customers, sync_invoices
from examples.harness import wait_for_records

BUDGETS = {
    "billing:api (sync_*)": (("sync_invoices", "sync_customers"), 4),
    "send_email": (("send_email",), 2),
}


def _max_in_window(times: list[int], window: int = 1_000_000) -> int:
    times = sorted(times)
    return max(
        (i + 1 - bisect.bisect_right(times, t - window) for i, t in enumerate(times)), default=0
    )


def main(timeout: float = 120.0) -> int:
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(RUNS)
    for account in range(6):
        sync_invoices.delay(account)
        sync_customers.delay(account)
    for n in range(6):
        send_email.delay(f"user{n}@example.com")
    cleanup.delay()  # not limited, so not recorded
    total = 18
    print(f"sent {total} limited tasks (and one unlimited)")
    if not wait_for_records(client, RUNS, total, timeout, "tasks"):
        return 1
    runs = [raw.decode().split() for raw in client.lrange(RUNS, 0, -1)]  # type: ignore[union-attr]
    held = True
    for budget, (tasks, limit) in BUDGETS.items():
        times = [int(at) for name, at in runs if name.rsplit(".", 1)[1] in tasks]
        most = _max_in_window(times)
        held &= most <= limit
        print(f"{budget:22s} {len(times):3d} runs, most in any second {most} (limit {limit})")
    print("result: " + ("the rules held" if held else "A RULE WAS EXCEEDED"))
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
