"""A per-tenant API client: each tenant gets its own budget on a metered upstream API.

One Celery task calls the upstream API on behalf of a tenant; the limit's key is a
template formatted from the call's ``tenant`` argument, so each tenant has its own
budget of ``TENANT_RATE`` (default 5 calls per second), shared by every worker node.
A noisy tenant is deferred; the others are not slowed down.

Run it (a Redis on localhost, or the URLs below; docker-compose.yml runs the same)::

    celery -A examples.per_tenant_api worker -c 2 -n a@%h &
    celery -A examples.per_tenant_api worker -c 2 -n b@%h &
    python -m examples.per_tenant_api produce

Environment: ``CELERY_BROKER_URL`` (default ``redis://localhost:6379/1``),
``RATELIMIT_REDIS_URL`` (default ``redis://localhost:6379/0``), ``TENANT_RATE``,
``TENANT_CALLS`` (calls per tenant sent by ``produce``).
"""

from __future__ import annotations

import bisect
import os
import sys
from typing import Any

import redis
from celery import Celery

from celery_ratelimit import Limit, Rate, RateLimitedTask
from examples.harness import produce_command, wait_for_records

BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/1")
REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://localhost:6379/0")
TENANT_RATE = Rate.parse(os.environ.get("TENANT_RATE", "5/s"))
TENANT_CALLS = int(os.environ.get("TENANT_CALLS", "10"))
TENANTS = ("acme", "globex", "initech")
RUNS = "example:tenant:runs"

app = Celery("per_tenant_api", broker=BROKER_URL)
app.conf.update(
    ratelimit_redis_url=REDIS_URL,
    ratelimit_key_prefix="example",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

# The Redis Cluster hash tag picks the slot (and so the cluster node) that holds the
# key: a key's first and last segments. "{tenant}:api" renders "acme:api", tagged
# "acme:api" ("api:{tenant}" would be tagged "api:acme", as good), so tenants hash to
# different slots and spread over the cluster. A producer checking
# `limiter.peek("acme:api", ...)` reads this very budget: a key is its string, however
# it is reached. (Limits checked together in one call must share the tag: a per-tenant
# quota next to this one would be "{tenant}:quota:api".) On a single Redis it makes no
# difference.
TENANT_LIMIT = Limit(TENANT_RATE, key="{tenant}:api", name="tenant-api")

_client: redis.Redis | None = None


@app.task(base=RateLimitedTask, bind=True, ratelimit=TENANT_LIMIT)
def call_api(self: Any, tenant: str, path: str) -> str:
    """One call to the metered upstream API for ``tenant`` (recorded for the report)."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS_URL)
    granted = int(self.request.ratelimit_decision.at * 1_000_000)
    _client.rpush(RUNS, f"{tenant} {granted}")
    return f"GET {path} for {tenant}: 200"


def _max_in_window(times: list[int], window: int) -> int:
    times = sorted(times)
    return max(
        (i + 1 - bisect.bisect_right(times, t - window) for i, t in enumerate(times)), default=0
    )


def produce(calls: int, timeout: float = 120.0) -> int:
    """Send ``calls`` calls per tenant (the first tenant sends three times as many),
    wait until all ran, print each tenant's busiest window against its limit."""
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(RUNS)
    sent = {tenant: calls * (3 if i == 0 else 1) for i, tenant in enumerate(TENANTS)}
    for n in range(max(sent.values())):
        for tenant, count in sent.items():
            if n < count:
                call_api.delay(tenant, f"/v1/items/{n}")
    total = sum(sent.values())
    print(f"sent {total} calls for {len(TENANTS)} tenants, limit {TENANT_RATE} each")
    if not wait_for_records(client, RUNS, total, timeout):
        return 1
    grants: dict[str, list[int]] = {tenant: [] for tenant in TENANTS}
    for raw in client.lrange(RUNS, 0, -1):
        tenant, at = raw.decode().split()  # type: ignore[union-attr]
        grants[tenant].append(int(at))
    held = True
    for tenant, times in grants.items():
        most = _max_in_window(times, TENANT_RATE.window_us)
        span = (max(times) - min(times)) / 1e6
        held &= most <= TENANT_RATE.limit
        print(
            f"{tenant:8s} {len(times):4d} calls in {span:5.2f}s, "
            f"most in any window {most} (limit {TENANT_RATE.limit})"
        )
    print("result: " + ("every tenant stayed within its limit" if held else "LIMIT EXCEEDED"))
    return 0 if held else 1


main = produce_command(produce, "calls", TENANT_CALLS, "send calls for every tenant and report")


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s: task names come from the module name.
    from examples.per_tenant_api import main as _main

    sys.exit(_main())
