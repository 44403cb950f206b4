"""The operator's page at scale: ``python -m benchmarks.bench_web [--keys 10000]``.

A private redis-server holds ``--keys`` tenant keys under the prefix (``api:t<n>``, one
grant each in a minute's window, a tenth of them paused), the page is served by its
command line (``celery-ratelimit web --url``), and:

- the API's first page (``GET /api/keys``, 50 keys found by SCAN from cursor 0): the
  median and worst of 10 requests;
- the first screen in a real browser (Debian's chromium through playwright, when
  installed): from ``goto`` to the first key's row drawn, the median of 3 fresh pages;
- Redis's CPU while one browser polls the page every second for ``--seconds`` (the
  server's ``used_cpu_user + used_cpu_sys``, as a share of one core).

The figures are printed and written to ``benchmarks/results/web.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import urllib.request
from typing import Any

from benchmarks.output import save
from celery_ratelimit import Limit, Limiter
from celery_ratelimit._tools.embedded import RedisServer
from tests.web_server import WebServer


def fill(limiter: Limiter, keys: int) -> None:
    for n in range(keys):
        limiter.acquire(f"api:t{n}", Limit("5/m"))
        if n % 10 == 0:
            limiter.pause(f"api:t{n}", 600)


def api_first_page(url: str, tries: int = 10) -> list[float]:
    times = []
    for _ in range(tries):
        started = time.perf_counter()
        with urllib.request.urlopen(url + "api/keys?cursor=0", timeout=30) as answer:
            document = json.loads(answer.read())
        times.append(time.perf_counter() - started)
        assert document["error"] is None and document["families"], document
    return times


def redis_cpu(client: Any) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def browser_figures(url: str, seconds: float, client: Any) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        return {"browser": "no chromium on PATH"}
    screens = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=["--no-sandbox"])
        for _ in range(3):
            page = browser.new_page()
            started = time.perf_counter()
            page.goto(url)
            page.locator("tr[data-key]").first.wait_for(timeout=30_000)
            screens.append(time.perf_counter() - started)
            page.close()
        page = browser.new_page()
        page.goto(url)
        page.locator("tr[data-key]").first.wait_for(timeout=30_000)
        cpu, wall = redis_cpu(client), time.perf_counter()
        time.sleep(seconds)
        share = (redis_cpu(client) - cpu) / (time.perf_counter() - wall)
        browser.close()
    return {
        "first_screen_s": screens,
        "first_screen_median_s": statistics.median(screens),
        "redis_cpu_share_polling": share,
    }


def run(keys: int, seconds: float) -> dict[str, Any]:
    with RedisServer() as server:
        limiter = Limiter.from_url(server.url, prefix="bench")
        started = time.perf_counter()
        fill(limiter, keys)
        filled = time.perf_counter() - started
        with WebServer("--url", server.url, "--prefix", "bench") as web:
            api = api_first_page(web.url)
            result: dict[str, Any] = {
                "keys": keys,
                "names_under_prefix": server.client().dbsize(),
                "fill_s": filled,
                "api_first_page_median_s": statistics.median(api),
                "api_first_page_worst_s": max(api),
                **browser_figures(web.url, seconds, server.client()),
            }
        limiter.client.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=10_000, help="tenant keys (default 10,000)")
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="polling time for Redis's CPU (default 20)"
    )
    args = parser.parse_args()
    result = run(args.keys, args.seconds)
    save("web.json", result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
