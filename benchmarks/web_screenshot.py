"""The screenshot of the operator's page in docs/operations.md:
``python -m benchmarks.web_screenshot [PNG] [--seconds 60]``.

A private redis-server, the page served for the test app (``tests.apps.nodes``: its
declared limits give each key's family and limit) and opened in Debian's chromium;
calls on two tenant keys for ``--seconds`` (the chart), then a backlog on a third, a
pause, an override, a concurrency key with its leases and an upstream's quota, and the
shot.
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time

from celery_ratelimit import Concurrency, Limit, Limiter
from celery_ratelimit._tools.embedded import RedisServer
from tests.web_server import WebServer


def traffic(limiter: Limiter, stop: threading.Event) -> None:
    """Calls on api:t1 and api:t3, faster and slower by turns."""
    n = 0
    while not stop.is_set():
        for tenant in ("t1", "t3"):
            limiter.acquire(f"api:{tenant}", Limit("10/s"))
        n += 1
        time.sleep(0.05 if (n // 150) % 2 == 0 else 0.2)


def scene(limiter: Limiter) -> None:
    """What the shot shows besides the traffic."""
    for _ in range(40):
        limiter.acquire("api:t2", Limit("10/s"), reserve=True, horizon=600)
    limiter.pause("api:t2", 45)
    limiter.override("api:t3", "5/s", ttl=300)
    limiter.acquire("slots", Concurrency(2, lease=300))
    limiter.acquire("slots", Concurrency(2, lease=120))
    limiter.acquire("slots", Concurrency(2), reserve=True)
    headers = {"X-RateLimit-Limit": "100", "X-RateLimit-Remaining": "40"}
    limiter.observe("quota:search", {**headers, "X-RateLimit-Reset": "25"}, Limit("3/s"))


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("png", nargs="?", default="docs/images/web.png")
    parser.add_argument("--seconds", type=float, default=60.0, help="traffic before the shot")
    args = parser.parse_args()
    with RedisServer() as server, sync_playwright() as playwright:
        limiter = Limiter.from_url(server.url, prefix="crl")
        env = {"CRL_REDIS": server.url, "CRL_PREFIX": "crl"}
        with WebServer(celery_app="tests.apps.nodes", env=env) as web:
            browser = playwright.chromium.launch(
                executable_path=shutil.which("chromium") or "chromium", args=["--no-sandbox"]
            )
            page = browser.new_page(viewport={"width": 1700, "height": 600})
            stop = threading.Event()
            thread = threading.Thread(target=traffic, args=(limiter, stop), daemon=True)
            thread.start()
            page.goto(web.url)
            time.sleep(args.seconds)
            scene(limiter)
            time.sleep(2.2)
            page.screenshot(path=args.png)
            stop.set()
            thread.join()
            browser.close()
        limiter.client.close()


if __name__ == "__main__":
    main()
