"""The operator's page in a real browser (Debian's chromium, driven by playwright)
against a real redis-server while three real ``celery worker`` nodes drain a backlog:
the keys and their used/limit, the drain time counting down, a pause set from the
command line showing within 2 s, an action on the page changing the next decision, an
action without the token refused."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_ratelimit import Limit, Limiter
from tests.examples_env import run
from tests.nodes import APP, Nodes
from tests.redis_server import RedisServer
from tests.web_server import WebServer

pytest.importorskip("starlette")
sync_api = pytest.importorskip("playwright.sync_api")

pytestmark = pytest.mark.celery
TOKEN = "t0ken-for-the-test"


def chromium() -> str:
    """The system's chromium; skip without one (fail if CRL_REQUIRE_CHROMIUM=1)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    reason = "no chromium on PATH (apt-get install chromium)"
    if os.environ.get("CRL_REQUIRE_CHROMIUM") == "1":
        pytest.fail(f"{reason}, and CRL_REQUIRE_CHROMIUM=1 requires it")
    pytest.skip(f"{reason} (set CRL_REQUIRE_CHROMIUM=1 to fail instead of skipping)")


@pytest.fixture
def browser() -> Iterator[Any]:
    path = chromium()
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield launched
        launched.close()


def drains(page: Any, key: str) -> float:
    text = page.locator(f'tr[data-key="{key}"][data-alg="log"] td.drains').inner_text()
    match = re.fullmatch(r"in ([\d.]+)s", text)
    assert match, text
    return float(match[1])


def test_the_page_follows_a_backlog_draining_on_three_nodes_and_acts_with_its_token(
    shared_nodes: Nodes, browser: Any
) -> None:
    nodes = shared_nodes
    where = ("--url", nodes.limiter_url, "--prefix", nodes.prefix)
    limiter = Limiter.from_url(nodes.limiter_url, prefix=nodes.prefix)
    with WebServer("--actions", "--token", TOKEN, celery_app=APP, env=nodes.env) as web:
        for i in range(100):  # 10 s of backlog at 10/s on api:t1, 2 s on api:t2
            nodes.send("per_tenant", "t1", i)
        for i in range(20):
            nodes.send("per_tenant", "t2", i)
        page = browser.new_page(viewport={"width": 1400, "height": 700})
        page.goto(web.url + "#token=" + TOKEN)
        t1 = page.locator('tr[data-key="api:t1"][data-alg="log"]')
        t1.wait_for(timeout=15_000)
        assert re.fullmatch(r"\d+/10", t1.locator("td.used").inner_text())
        assert "api:{tenant}" in page.locator("tr.family").first.inner_text()
        page.wait_for_function(
            "() => /^in /.test(document.querySelector("
            "'tr[data-key=\"api:t1\"][data-alg=\"log\"] td.drains')?.textContent || '')",
            timeout=10_000,
        )
        # counting down, refreshed each second, once every task of the backlog holds its
        # slot (until then each deferral reserves one past the last)
        readings = []
        for _ in range(4):
            readings.append(drains(page, "api:t1"))
            time.sleep(1.5)
            readings.append(drains(page, "api:t1"))
            if 0.5 < readings[-2] - readings[-1] < 2.6:
                break
        else:
            raise AssertionError(f"the drain time did not count down: {readings}")

        # a pause set from the command line shows within 2 s
        result = run(
            sys.executable, "-m", "celery_ratelimit", "pause", "api:t2", "30", *where, env={}
        )
        assert result.returncode == 0, result.stderr
        paused_at = time.monotonic()
        page.locator('tr.settings[data-key="api:t2"]', has_text="paused").wait_for(timeout=2_000)
        assert time.monotonic() - paused_at < 2.0
        assert limiter.peek("api:t2", Limit("10/s")).retry_after > 25

        # actions on the page change what the next decision sees
        page.fill("#act-key", "api:t2")
        page.click('button[data-action="resume"]')
        page.locator("#result", has_text="api:t2: resumed").wait_for(timeout=5_000)
        assert limiter.peek("api:t2", Limit("10/s")).retry_after < 5
        page.fill("#act-key", "web-probe")
        page.fill("#act-rate", "1/m")
        page.click('button[data-action="set"]')
        page.locator("#result", has_text="web-probe: 1/m on every worker").wait_for(timeout=5_000)
        assert [limiter.acquire("web-probe", Limit("100/m")).allowed for _ in range(2)] == [
            True,
            False,
        ]
        page.fill("#act-rate", "1/fortnight")
        page.click('button[data-action="set"]')
        page.locator("#result", has_text="error: cannot parse rate '1/fortnight'").wait_for(
            timeout=5_000
        )

        # without the token: refused, nothing changes
        page.fill("#token", "")
        page.fill("#act-key", "web-unpaused")
        page.click('button[data-action="pause"]')
        page.locator("#result", has_text="refused").wait_for(timeout=5_000)
        assert limiter.peek("web-unpaused", Limit("10/s")).allowed
    limiter.client.close()


def test_the_page_says_in_one_line_when_redis_is_down_and_comes_back(browser: Any) -> None:
    with RedisServer() as server:
        Limiter.from_url(server.url, prefix="p").acquire("k", Limit("5/m"))
        with WebServer("--url", server.url, "--prefix", "p") as web:
            page = browser.new_page()
            page.goto(web.url)
            page.locator('tr[data-key="k"]').wait_for(timeout=5_000)
            server.stop()
            page.locator("#error", has_text="error: Redis failed").wait_for(timeout=5_000)
            line = page.locator("#error").inner_text()
            assert "--url" in line and "Traceback" not in line and "\n" not in line
            server.start()
            Limiter.from_url(server.url, prefix="p").acquire("k", Limit("5/m"))
            page.wait_for_function("() => document.querySelector('#error').textContent === ''")
            page.locator('tr[data-key="k"]').wait_for(timeout=5_000)
        assert "the limiter's Redis answers again" in web.log()
