"""A per-tenant ERP sync: one sync session per tenant at a time, a shared request rate,
and the ERP's own 429s honoured by every worker.

The ERP (simulated here by a small HTTP server the producer starts) allows one open
session per tenant and answers 429 with a ``Retry-After`` when it is busy. Each task
syncs one page of one tenant:

- ``Concurrency(1, key="{tenant}:erp")``: never two sessions of one tenant at once,
  whichever worker runs them; the other pages of that tenant wait their turn in line;
- ``Limit(ERP_RATE, key="erp")``: the requests of all tenants together stay under the
  ERP's rate;
- a 429 raises ``UpstreamRateLimited(Retry-After)``: every worker stops calling the ERP
  until then, and the page is synced again after the pause (its retries untouched).

Run it (a Redis on localhost, or the URLs below)::

    celery -A examples.erp_sync worker -c 4 -n a@%h &
    celery -A examples.erp_sync worker -c 4 -n b@%h &
    python -m examples.erp_sync produce

Environment: ``CELERY_BROKER_URL`` (default ``redis://localhost:6379/1``),
``RATELIMIT_REDIS_URL`` (default ``redis://localhost:6379/0``), ``ERP_PORT`` (8765),
``ERP_RATE`` (``"20/s"``), ``ERP_PAGES`` (pages per tenant), ``ERP_BUSY_EVERY`` (the
ERP answers 429 to every n-th request).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from celery import Celery

from celery_ratelimit import Concurrency, Limit, RateLimitedTask, UpstreamRateLimited
from examples.harness import produce_command, serve

BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/1")
REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://localhost:6379/0")
ERP_PORT = int(os.environ.get("ERP_PORT", "8765"))
ERP_RATE = os.environ.get("ERP_RATE", "20/s")
ERP_PAGES = int(os.environ.get("ERP_PAGES", "6"))
ERP_BUSY_EVERY = int(os.environ.get("ERP_BUSY_EVERY", "15"))
TENANTS = ("acme", "globex", "initech")
#: How long the ERP takes to serve one page (seconds).
PAGE_SECONDS = 0.2

app = Celery("erp_sync", broker=BROKER_URL)
app.conf.update(
    ratelimit_redis_url=REDIS_URL,
    ratelimit_key_prefix="example-erp",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(
    base=RateLimitedTask,
    bind=True,
    ratelimit=[Concurrency(1, key="{tenant}:erp"), Limit(ERP_RATE, key="erp")],
)
def sync_page(self: Any, tenant: str, page: int) -> str:
    """Sync one page of ``tenant`` from the ERP."""
    url = f"http://127.0.0.1:{ERP_PORT}/sync?tenant={tenant}&page={page}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        if exc.code == 429:
            # every worker pauses the ERP's keys until then; this page runs again after
            raise UpstreamRateLimited(exc.headers.get("Retry-After")) from exc
        raise


class ERP:
    """The simulated ERP: what it served, and what it would have refused."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.open: dict[str, int] = {}
        self.most_open = 0
        self.busy_from = self.busy_until = 0.0
        self.served: list[tuple[str, int]] = []
        self.refused = 0
        self.during_pause = 0

    def handle(self, tenant: str, page: int) -> tuple[int, dict[str, str], str]:
        with self.lock:
            self.requests += 1
            if self.busy_from <= time.time() < self.busy_until:
                self.during_pause += 1
            if self.requests % ERP_BUSY_EVERY == 0:
                self.refused += 1
                # requests granted before the worker that got this answer paused the
                # key are on their way: they are not counted for the first 300 ms
                self.busy_from, self.busy_until = time.time() + 0.3, time.time() + 1
                return 429, {"Retry-After": "1"}, "busy"
            self.open[tenant] = self.open.get(tenant, 0) + 1
            self.most_open = max(self.most_open, self.open[tenant])
        time.sleep(PAGE_SECONDS)
        with self.lock:
            self.open[tenant] -= 1
            self.served.append((tenant, page))
        return 200, {}, json.dumps({"tenant": tenant, "page": page})


def produce(pages: int, timeout: float = 120.0) -> int:
    """Start the ERP, send ``pages`` pages per tenant, wait until every page is synced,
    and report what the ERP saw."""
    erp = ERP()
    server = serve(ERP_PORT, lambda q: erp.handle(q["tenant"], int(q["page"])))
    try:
        for page in range(pages):
            for tenant in TENANTS:
                sync_page.delay(tenant, page)
        total = pages * len(TENANTS)
        print(f"sent {total} pages for {len(TENANTS)} tenants")
        deadline = time.monotonic() + timeout
        while len(set(erp.served)) < total:
            if time.monotonic() > deadline:
                print(f"timed out: {len(set(erp.served))} of {total} pages synced", file=sys.stderr)
                return 1
            time.sleep(0.1)
        time.sleep(0.5)  # a duplicate would show now
    finally:
        server.shutdown()
    print(f"pages synced                     {len(erp.served)} of {total}")
    print(f"most open sessions of one tenant {erp.most_open} (the ERP allows 1)")
    print(f"429s answered                    {erp.refused}")
    print(f"requests while the ERP was busy  {erp.during_pause}")
    held = (
        erp.most_open <= 1
        and erp.during_pause == 0
        and sorted(erp.served) == sorted(set(erp.served))
    )
    print("result: " + ("the ERP's limits held" if held else "A LIMIT WAS BROKEN"))
    return 0 if held else 1


main = produce_command(produce, "pages", ERP_PAGES, "start the ERP, sync every tenant, report")


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s: task names come from the module name.
    from examples.erp_sync import main as _main

    sys.exit(_main())
