"""The operator's page's reading and its HTTP side, against real redis-servers: pages of
many keys by a SCAN cursor, search, keys under the prefix that are not ours, Redis down
then back, a bad URL and a wrong password, the chart's grants, the token and the host
check. The page in a real browser: ``test_web_browser.py``."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from celery_ratelimit import Concurrency, Limit, Limiter
from celery_ratelimit._tools.web.source import Source
from tests.examples_env import run
from tests.redis_server import RedisServer, free_port
from tests.web_server import WebServer

pytest.importorskip("starlette")

TENANTS = 1_200


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of the test's own (tests stop it, fill it)."""
    with RedisServer() as private:
        yield private


def keys_of(document: dict[str, Any]) -> list[str]:
    return [entry["key"] for family in document["families"] for entry in family["keys"]]


def fill(limiter: Limiter, tenants: int) -> None:
    """One grant on ``api:t<n>`` for each tenant (a window of a minute: nothing leaves)."""
    for n in range(tenants):
        assert limiter.acquire(f"api:t{n}", Limit("5/m")).allowed


def test_pages_by_cursor_cover_every_key_once_and_never_all_at_once(server: RedisServer) -> None:
    """1,200 tenant keys and the names under the prefix that are not the limiter's: each
    page holds a bounded share, the pages together every key once, and the strangers
    are passed over (no row, no error)."""
    limiter = Limiter.from_url(server.url, prefix="p")
    fill(limiter, TENANTS)
    client = limiter.client
    client.set("p:stranger", "x")
    client.set("p:{api:t1}:log:not-a-window", "x")  # a name of our shape but not ours
    client.hset("p:{x}:y:settings", "other", "1")  # a settings hash of a key tagged wrong
    client.rpush("p:runs", "x")
    client.set("p:{api:t5}:log:60000000:x", "x")
    client.set("p:{odd}:log:60000000", "a string where a log would be")
    source = Source(None, server.url, "p")
    seen: list[str] = []
    cursor, pages = 0, 0
    while True:
        page = source.page(None, cursor, size=50)
        assert page["error"] is None
        assert len(keys_of(page)) <= 400  # about a page: SCAN batches are kept whole
        seen += keys_of(page)
        pages += 1
        if page["next"] is None:
            break
        cursor = page["next"]
    assert sorted(seen) == sorted(f"api:t{n}" for n in range(TENANTS))
    assert pages >= 4
    (family,) = source.page(None, 0, size=50)["families"]
    assert family["family"] == "api:*"  # without the app: the key's last segment as *
    row = family["keys"][0]["limits"][0]
    assert (row["used"], row["window_s"], row["algorithm"]) == (1, 60.0, "log")


def test_search_finds_the_keys_it_names_among_many(server: RedisServer) -> None:
    limiter = Limiter.from_url(server.url, prefix="p")
    fill(limiter, TENANTS)
    limiter.pause("api:t7", 30)
    source = Source(None, server.url, "p")
    found: list[str] = []
    cursor: int | None = 0
    while cursor is not None:
        page = source.page("t11", cursor, size=50)
        found += keys_of(page)
        cursor = page["next"]
    assert sorted(found) == sorted(f"api:t{n}" for n in range(TENANTS) if "t11" in f"t{n}")
    page = source.page("api:t7", 0, size=500)  # text: anywhere in the key
    assert sorted(keys_of(page)) == sorted(f"api:t{n}" for n in range(TENANTS) if "t7" in f"t{n}")
    (entry,) = [e for f in page["families"] for e in f["keys"] if e["key"] == "api:t7"]
    assert 29 < entry["settings"]["paused_for_s"] <= 30
    assert sorted(keys_of(source.page("api:t1?", 0))) == sorted(f"api:t1{n}" for n in range(10))


def test_rows_carry_concurrency_leases_backlog_and_the_chart_counts_grants(
    server: RedisServer,
) -> None:
    limiter = Limiter.from_url(server.url, prefix="p")
    for _ in range(7):
        limiter.acquire("busy", Limit("3/m"), reserve=True, horizon=600)  # 3 granted, 4 reserved
    limiter.acquire("erp", Concurrency(2, lease=120))
    limiter.override("busy", "3/m", ttl=90)
    source = Source(None, server.url, "p")
    page = source.page(None, 0)
    rows = {e["key"]: e for f in page["families"] for e in f["keys"]}
    (busy,) = rows["busy"]["limits"]
    assert (busy["used"], busy["limit"], busy["reservations"]) == (3, 3, 4)
    assert 119 < busy["drains_in_s"] <= 120.1  # the last reserved slot: two windows on
    assert 89 < rows["busy"]["settings"]["override_for_s"] <= 90
    (erp,) = rows["erp"]["limits"]
    assert erp["used"] == 1 and 119 < erp["leases_s"][0] <= 120
    assert sum(page["grants"]) == 3 and len(page["grants"]) == 300  # grants, not reservations
    assert sum(source.page(None, 0)["grants"]) == 3  # read again: counted once


def test_redis_down_then_back_and_a_bad_url_or_password_are_one_line(
    server: RedisServer,
) -> None:
    limiter = Limiter.from_url(server.url, prefix="p")
    limiter.acquire("k", Limit("5/m"))
    source = Source(None, server.url, "p")
    assert keys_of(source.page(None, 0)) == ["k"]
    server.stop()
    down = source.page(None, 0)
    assert down["error"].startswith("error: ") and "--url" in down["error"]
    assert "Traceback" not in down["error"] and "families" not in down
    server.start()
    limiter.acquire("k", Limit("5/m"))
    assert source.page(None, 0)["error"] is None  # the same source: it recovers
    bad = Source(None, "http://127.0.0.1:1/0", "p").page(None, 0)
    assert bad["error"].startswith("error: ") and "http://" in bad["error"]
    with RedisServer() as locked:
        locked.client().config_set("requirepass", "right")
        wrong = locked.url.replace("redis://", "redis://:wrong@")
        refused = Source(None, wrong, "p").page(None, 0)
    assert refused["error"].startswith("error: ") and "password" in refused["error"].lower()
    assert "wrong" not in refused["where"]  # the password is never shown


def post(url: str, body: dict[str, Any], token: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["X-Ratelimit-Token"] = token
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_actions_need_the_flag_and_the_token_and_say_what_the_cli_says(
    server: RedisServer,
) -> None:
    limiter = Limiter.from_url(server.url, prefix="p")
    where = ("--url", server.url, "--prefix", "p")
    with WebServer(*where) as page:  # no --actions: the page changes nothing
        status, answer = post(page.url + "api/action/pause", {"key": "k", "seconds": 9}, None)
        assert status == 403 and "--actions" in answer["error"]
    with WebServer(*where, "--actions", "--token", "s3cret") as page:
        status, answer = post(page.url + "api/action/pause", {"key": "k", "seconds": 9}, "nope")
        assert status == 401 and limiter.peek("k", Limit("5/m")).allowed
        with pytest.raises(urllib.error.HTTPError) as got:  # a change is never a GET
            urllib.request.urlopen(page.url + "api/action/pause?key=k&seconds=9", timeout=10)
        assert got.value.code == 405
        status, answer = post(
            page.url + "api/action/set", {"key": "k", "rate": "1/fortnight"}, "s3cret"
        )
        cli = run(
            sys.executable, "-m", "celery_ratelimit", "set", "k", "1/fortnight", *where, env={}
        )
        assert status == 400 and cli.returncode == 1
        assert answer["error"] == cli.stderr.strip()  # the command line's own message
        status, answer = post(page.url + "api/action/set", {"key": "k", "rate": "1/m"}, "s3cret")
        assert status == 200 and answer["lines"] == [
            "k: 1/m on every worker from its next decision, until unset"
        ]
        assert [limiter.acquire("k", Limit("5/m")).allowed for _ in range(2)] == [True, False]
        status, answer = post(page.url + "api/action/reset", {"key": "k"}, "s3cret")
        assert status == 200 and limiter.client.exists("p:{k}:log:60000000") == 0
        status, answer = post(page.url + "api/action/pause", {"key": "k", "seconds": "x"}, "s3cret")
        assert status == 400 and answer["error"].startswith("error: not a Retry-After value")
    assert "refused pause without the token" in page.log()


def test_a_page_on_loopback_answers_to_loopback_names_only(server: RedisServer) -> None:
    """A web site whose name resolves to 127.0.0.1 (DNS rebinding) cannot read the page."""
    with WebServer("--url", server.url) as page:
        ours = urllib.request.Request(page.url + "api/keys", headers={"Host": "localhost"})
        with urllib.request.urlopen(ours, timeout=10) as answer:
            assert answer.status == 200
        theirs = urllib.request.Request(page.url + "api/keys", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as got:
            urllib.request.urlopen(theirs, timeout=10)
        assert got.value.code == 400
        with urllib.request.urlopen(page.url, timeout=10) as answer:
            assert "frame-ancestors 'none'" in answer.headers["Content-Security-Policy"]


def test_actions_without_a_token_given_make_one_and_print_it(server: RedisServer) -> None:
    with WebServer("--url", server.url, "--prefix", "p", "--actions") as page:
        made = re.search(r"the token \(made for this run\): (\S+);", page.log())
        assert made, page.log()
        status, _ = post(page.url + "api/action/pause", {"key": "k", "seconds": 5}, "guess")
        assert status == 401
        status, answer = post(page.url + "api/action/pause", {"key": "k", "seconds": 5}, made[1])
        assert status == 200, answer


def test_a_host_other_than_loopback_without_a_token_refuses_to_start(server: RedisServer) -> None:
    ours = run(sys.executable, "-m", "celery_ratelimit", "web", "--url", server.url,
               "--host", "0.0.0.0", "--port", str(free_port()), env={})  # fmt: skip
    celerys = run(sys.executable, "-m", "celery", "-A", "tests.apps.nodes", "ratelimit", "web",
                  "--host", "0.0.0.0", "--port", str(free_port()), env={})  # fmt: skip
    for result in (ours, celerys):
        assert result.returncode == 2, result.stdout + result.stderr
        assert (
            "error: refusing to serve on 0.0.0.0: a page other machines can reach needs a token"
            in result.stderr
        )
        assert "Traceback" not in result.stderr


def test_a_long_search_scan_answers_within_its_budget(server: RedisServer) -> None:
    """A search that matches nothing among many names answers with how far it got and a
    cursor to go on, in a bounded time."""
    limiter = Limiter.from_url(server.url, prefix="p")
    pipe = limiter.client.pipeline(transaction=False)
    for n in range(60_000):
        pipe.set(f"p:stranger:{n}", "x")
    pipe.execute()
    started = time.monotonic()
    page = Source(None, server.url, "p").page(None, 0)
    assert time.monotonic() - started < 2
    assert keys_of(page) == [] and page["scanned"] >= 50_000 and page["next"] is not None
