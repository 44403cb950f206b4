"""The command lines as a user runs them: ``celery-ratelimit status|reset|set|unset|explain``
(``python -m celery_ratelimit``), ``celery -A app ratelimit ...`` through the entry
point, and the demo, against private redis-servers."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ratelimit import Concurrency, Limit, Limiter, Rate, RateLimitedTask, install
from celery_ratelimit._engine import failures as _failures
from celery_ratelimit._engine.keys import render
from celery_ratelimit._tools.ops import known_limits, status
from tests.examples_env import run
from tests.redis_server import RedisServer, free_port

DAY_US = 600_000_000  # the quota example's "day", made long so nothing expires mid-test
QUOTA = Rate(9500, DAY_US)
SEARCH = Rate(25, DAY_US // 24)
APP = "examples.quota_ingestion"
CELERY = str(Path(sys.executable).parent / "celery")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def env(server: RedisServer) -> dict[str, str]:
    return {
        "RATELIMIT_REDIS_URL": server.url,
        "CELERY_BROKER_URL": server.url.replace("/0", "/1"),
        "YT_DAY_SECONDS": str(DAY_US // 1_000_000),
    }


@pytest.fixture
def limiter(server: RedisServer) -> Iterator[Limiter]:
    limiter = Limiter.from_url(server.url, prefix="example")
    yield limiter
    limiter.client.close()


def cli(*args: str, env: dict[str, str]) -> str:
    result = run(sys.executable, "-m", "celery_ratelimit", *args, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def seconds_after(text: str, before: str) -> float:
    """The time the CLI printed after ``before`` ("in 29.712s", "in 9.9m", "in 1.2h"), in
    seconds: tests bound it rather than match its digits, which move with the machine."""
    match = re.search(re.escape(before) + r" in ([\d.]+)([smh])", text)
    assert match, text
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600}[match[2]]


def populate(limiter: Limiter) -> None:
    """The quota at 301 of 9500, the search cap full with one slot reserved, and a key
    the app does not declare."""
    limiter.acquire("yt:quota:key1", Limit(QUOTA), cost=300)
    limiter.acquire("yt:quota:key1", Limit(QUOTA), cost=1)
    for _ in range(25):
        assert limiter.acquire("yt:search:key1", Limit(SEARCH)).allowed
    assert limiter.acquire("yt:search:key1", Limit(SEARCH), reserve=True).reserved
    for _ in range(3):
        limiter.acquire("adhoc:job", "10/m")


def row(output: str, key: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.startswith(key + " "))
    return line.split()


def test_status_shows_used_over_limit_for_the_apps_limits(
    limiter: Limiter, env: dict[str, str]
) -> None:
    populate(limiter)
    out = cli("status", "-A", APP, env=env)
    assert "prefix 'example'" in out and "3 active key(s)" in out
    quota = row(out, "yt:quota:key1")
    assert quota[1:7] == ["600s", "log", "301/9500", "9199", "0", "-"]  # no backlog
    assert quota[7] == "now"
    search = row(out, "yt:search:key1")
    assert search[1:6] == ["25s", "log", "25/25", "0", "1"]  # full, one slot reserved
    drains = float(re.match(r"([\d.]+)s", search[7])[1])  # type: ignore[index]
    wait = float(re.match(r"([\d.]+)s", search[9])[1])  # type: ignore[index]
    assert 0 < wait <= 25  # when the full window's oldest call leaves
    assert 0 < drains <= wait  # the reserved slot: a new call fits after it
    adhoc = row(out, "adhoc:job")
    assert adhoc[1:8] == ["1m", "log", "3", "?", "0", "-", "?"]
    assert "not declared by the app" in " ".join(adhoc)
    # -A before the command, as in `celery -A proj worker`: the same report
    before = cli("-A", APP, "status", env=env)
    assert "3 active key(s)" in before and row(before, "yt:quota:key1")[1:7] == quota[1:7]
    assert "not declared by the app" in " ".join(row(before, "adhoc:job"))


def test_status_by_url_and_prefix_without_an_app(
    server: RedisServer, limiter: Limiter, env: dict[str, str]
) -> None:
    populate(limiter)
    out = cli("status", "--url", server.url, "--prefix", "example", "--match", "yt:*", env=env)
    assert "2 active key(s)" in out
    assert row(out, "yt:quota:key1")[1:4] == ["600s", "log", "301"]
    assert "adhoc:job" not in out
    # what needs the app is said plainly, and what Redis holds is shown: an override too
    assert "declared limit: needs the app (-A)" in " ".join(row(out, "yt:quota:key1"))
    assert "Without the app (-A proj)" in out
    cli("set", "yt:quota:key1", "400/600s", "--url", server.url, "--prefix", "example", env=env)
    out = cli("status", "--url", server.url, "--prefix", "example", "--match", "yt:*", env=env)
    assert row(out, "yt:quota:key1")[3] == "301/400" and "overridden: 400/600s" in out


def test_explain_takes_url_and_prefix_and_counts_against_the_override(
    server: RedisServer, limiter: Limiter, env: dict[str, str]
) -> None:
    populate(limiter)  # the search cap full (25/25)
    cli("set", "yt:search:key1", "30/25s", "--url", server.url, "--prefix", "example", env=env)
    elsewhere = {**env, "RATELIMIT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    where = ("--url", server.url, "--prefix", "example")
    call = (f"{APP}.search_list", "key1", "US", "--kwargs", '{"query": "cats"}')
    ours = cli("explain", "-A", APP, *call, *where, env=elsewhere)
    first = cli("-A", APP, *where, "explain", *call, env=elsewhere)  # the options first
    result = run(CELERY, "-A", APP, "ratelimit", "explain", *call, *where, env=elsewhere)
    assert result.returncode == 0, result.stdout + result.stderr
    for out in (ours, first, result.stdout):
        assert "used 25/30" in out and "overridden 30/25s (declared 25/25s)" in out
        assert "override yt:search:key1: 30/25s (until unset)" in out


def test_celery_subcommand_status_through_the_entry_point(
    limiter: Limiter, env: dict[str, str]
) -> None:
    populate(limiter)
    result = run(CELERY, "-A", APP, "ratelimit", "status", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert row(result.stdout, "yt:quota:key1")[3] == "301/9500"
    assert row(result.stdout, "yt:search:key1")[3:6] == ["25/25", "0", "1"]
    # the same document by both doors
    door = run(CELERY, "-A", APP, "ratelimit", "status", "--json", "--sort", "used", env=env)
    assert door.returncode == 0, door.stdout + door.stderr
    keys = [one["key"] for one in json.loads(door.stdout)["keys"]]
    assert keys == [one["key"] for one in status_json(env, "--sort", "used")["keys"]]
    helptext = run(CELERY, "-A", APP, "ratelimit", "--help", env=env).stdout
    assert all(name in helptext for name in ("status", "reset", "explain"))


def seconds(redis_time: tuple[int, int]) -> float:
    return redis_time[0] + redis_time[1] / 1e6


def status_json(env: dict[str, str], *args: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(cli("status", "-A", APP, "--json", *args, env=env))
    return document


def test_status_json_sorts_by_backlog_or_share_and_says_when_a_backlog_drains(
    limiter: Limiter, env: dict[str, str]
) -> None:
    """``status --json`` for scripts: every key with its numbers (the drain time is the
    last reserved slot), ordered by ``--sort``, cut by ``--limit``; the settings beside."""
    populate(limiter)
    for _ in range(2):  # two more slots on the search cap: its backlog drains later
        assert limiter.acquire("yt:search:key1", Limit(SEARCH), reserve=True).reserved
    limiter.override("adhoc:job", "5/m", ttl=60)
    before = limiter.client.time()
    by_key = status_json(env)
    after = limiter.client.time()
    assert [k["key"] for k in by_key["keys"]] == ["adhoc:job", "yt:quota:key1", "yt:search:key1"]
    search = next(k for k in by_key["keys"] if k["key"] == "yt:search:key1")
    assert (search["used"], search["limit"], search["reservations"]) == (25, 25, 3)
    entries = limiter.client.zrange(search["redis_key"], 0, -1, withscores=True)
    last = max(score for _, score in entries) / 1e6
    # read by the CLI between these two instants: the last slot, that long ahead
    assert last - seconds(after) <= search["drains_in_s"] <= last - seconds(before)
    assert 0 < search["drains_in_s"] <= search["next_free_s"] <= 25
    quota = next(k for k in by_key["keys"] if k["key"] == "yt:quota:key1")
    assert (quota["used"], quota["limit"], quota["drains_in_s"]) == (301, 9500, None)
    adhoc = next(k for k in by_key["keys"] if k["key"] == "adhoc:job")
    assert (adhoc["used"], adhoc["limit"], adhoc["override"]) == (3, 5, "5/m")
    (settings,) = by_key["settings"]
    assert (settings["key"], settings["override"]) == ("adhoc:job", "5/m")
    assert 0 < settings["override_for_s"] <= 60
    backlog = status_json(env, "--sort", "backlog", "--limit", "1")["keys"]
    assert [k["key"] for k in backlog] == ["yt:search:key1"]
    used = status_json(env, "--sort", "used")["keys"]
    assert [k["key"] for k in used] == ["yt:search:key1", "adhoc:job", "yt:quota:key1"]


def test_reset_removes_every_window_of_the_key_and_nothing_else(
    server: RedisServer, limiter: Limiter, env: dict[str, str]
) -> None:
    populate(limiter)
    # (windows of a minute: a 10/s key would expire while the command starts on a busy machine)
    limiter.acquire("yt:quota:key1", "10/m")  # a second window on the same key
    limiter.acquire("yt:quota:key10", "10/m")  # a longer key with the same beginning
    client = redis.Redis.from_url(server.url)
    before = {k.decode() for k in client.keys("example:*")}
    out = cli("reset", "yt:quota:key1", "-A", APP, env=env)
    deleted = {line.split()[1] for line in out.splitlines()}
    assert deleted == {
        "example:{yt:key1}:yt:quota:key1:log:600000000",
        "example:{yt:key1}:yt:quota:key1:log:60000000",
    }
    assert {k.decode() for k in client.keys("example:*")} == before - deleted
    assert "nothing to reset" in cli(
        "reset", "yt:quota:key1", "--url", server.url, "--prefix", "example", env=env
    )
    client.close()


def test_explain_shows_limits_keys_and_decision_without_consuming(
    server: RedisServer, limiter: Limiter, env: dict[str, str]
) -> None:
    # the task's key, as its template renders it: tagged with the API key (``_keys``)
    rendered = render("yt:quota:{api_key}", {"api_key": "key1"}, ())
    limiter.acquire([rendered], Limit(QUOTA), 9450)
    client = redis.Redis.from_url(server.url)
    key = "example:{yt:key1}:yt:quota:key1:log:600000000"
    state = (client.zscore(key, ""), client.zcard(key), client.pttl(key) > 0)
    task = f"{APP}.search_list"
    out = cli("explain", "-A", APP, task, "key1", "US", "--kwargs", '{"query": "cats"}', env=env)
    assert f"call      {task}('key1', 'US', query='cats')" in out
    assert "limits    the task's ratelimit option" in out
    assert "1. yt:quota:{api_key}@9500/600s  (9500/600s, log, cost 100)" in out
    assert f"redis key  {key}" in out
    assert "redis key  example:{yt:key1}:yt:search:key1:log:25000000" in out
    assert "used 9450/9500 (0 reserved slot(s)), remaining 50" in out
    denied = "decision  denied by yt:quota:{api_key}@9500/600s: it fits"
    assert 0 < seconds_after(out, denied) <= 600
    assert "nothing was counted" in out
    # peek: the quota's total and entries are as they were, and the cap's key was not made
    assert (client.zscore(key, ""), client.zcard(key), client.pttl(key) > 0) == state
    assert not client.exists("example:{yt:key1}:yt:search:key1:log:25000000")
    # a cheap call still fits
    out = cli("explain", "-A", APP, f"{APP}.videos_list", "key1", "US", "3", env=env)
    assert "decision  allowed now (50 free before this call)" in out
    assert client.zcard(key) == state[1]
    client.close()


def test_explain_resolves_install_rules_and_reports_bad_calls(env: dict[str, str]) -> None:
    app = "examples.existing_project"
    task = "examples.existing_project.tasks.send_email"
    out = cli("explain", "-A", app, task, "a@example.com", env=env)
    assert "limits    app.conf.ratelimit_rules (install)" in out
    assert f"redis key  example:{{{task}}}:log:1000000" in out
    assert "decision  allowed now (2 free before this call)" in out
    out = cli("explain", "-A", app, "examples.existing_project.tasks.cleanup", env=env)
    assert "not rate limited" in out
    explain = (sys.executable, "-m", "celery_ratelimit", "explain")
    result = run(*explain, "-A", APP, f"{APP}.videos_list", "key1", env=env)
    assert result.returncode == 1  # a call Celery would refuse
    assert "error     Celery would refuse this call" in result.stdout
    assert "missing a required argument: 'region'" in result.stdout
    result = run(*explain, "-A", APP, "nope", env=env)
    assert result.returncode != 0 and f"{APP}.search_list" in result.stderr


def test_status_names_each_source_of_a_key_once(limiter: Limiter) -> None:
    """Three forms on one key template: ``status`` names the rule of a task's exact name
    once ("rule X"), not again as the task X its install limited; the other tasks by
    their names."""
    app = Celery("sources", broker="memory://", set_as_current=False)
    # a key template no other test's task has (shared tasks join every app)
    template = "sources-api:{tenant}"
    app.conf.ratelimit_rules = {"sources.by_rule": Limit("5/s", key=template)}

    @app.task(name="sources.by_rule", shared=False)
    def by_rule(tenant: str) -> None: ...

    @app.task(
        name="sources.by_base",
        base=RateLimitedTask,
        ratelimit=Limit("5/s", key=template),
        shared=False,
    )
    def by_base(tenant: str) -> None: ...

    install(app)
    limiter.acquire("sources-api:acme", "5/s")
    rows = status(limiter, known_limits(app))
    assert [row.sources for row in rows] == [["rule sources.by_rule", "sources.by_base"]]


def test_explain_fails_clearly_without_a_traceback(env: dict[str, str]) -> None:
    explain = (sys.executable, "-m", "celery_ratelimit", "explain")
    result = run(*explain, "-A", "nosuchmodule", "t", env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "cannot load the Celery app 'nosuchmodule'" in result.stderr
    faults = "tests.apps.faults"
    result = run(*explain, "-A", faults, f"{faults}.cost_raises", "1", env=env)
    assert result.returncode == 1
    assert (
        "a worker would fail this call: cost function of c@5/s raised LookupError: "
        "no price for this endpoint" in result.stdout
    )
    # the same through Celery's own command line
    result = run(
        CELERY, "-A", faults, "ratelimit", "explain", f"{faults}.cost_raises", "1", env=env
    )
    assert result.returncode == 1 and "raised LookupError" in result.stdout
    for output in (result.stdout, result.stderr):
        assert "Traceback" not in output


@pytest.mark.celery
def test_demo_runs_end_to_end_and_prints_the_report() -> None:
    result = run(
        sys.executable, "-m", "celery_ratelimit", "demo", "--nodes", "2", "--tasks", "20",
        "--rate", "10/s", env={}, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "tasks sent / executed          20 / 20" in out
    starts = re.search(r"most starts in any window\s+(\d+) \(limit 10", out)
    grants = re.search(r"most grants in any window\s+(\d+) ", out)
    assert starts and int(starts[1]) <= 10
    assert grants and int(grants[1]) <= 10
    assert re.search(r"drain time / ideal\s+[\d.]+s / 1\.00s", out)
    assert "limiter calls per task" in out
    assert "result: the shared limit held" in out
    assert "ideal drain 1.00s: 20 tasks at 10 per 1s fill 2 window(s)" in out
    # the live line counts starts in the last window, never above the limit that held
    counts = re.findall(r"(\d+) started (?:in the last 1s|so far) \(limit 10 per 1s\)", out)
    assert counts and max(map(int, counts)) <= 10, counts


def test_the_demo_progress_counts_starts_never_a_rate_over_part_of_a_window() -> None:
    from celery_ratelimit._tools.demo import progress_line

    rate = Rate.parse("10/s")
    # the whole limit at the start of each window, as the demo's first second goes
    starts = [w * 1_000_000 + i for w in range(3) for i in range(10)]
    for now in range(0, 3_000_000, 10_000):
        so_far = [t for t in starts if t <= now]
        line = progress_line(so_far, 30, rate, now / 1e6, 2.0, now_us=now)
        found = re.search(r"(\d+) started (in the last 1s|so far) \(limit 10 per 1s\)", line)
        assert found and int(found[1]) <= 10, line
        assert (found[2] == "so far") == (now < 1_000_000)
    early = progress_line(starts[:10], 30, rate, 0.3, 2.0, now_us=300_000)
    assert "10/30 executed, 20 waiting, 10 started so far (limit 10 per 1s)" in early


@pytest.mark.parametrize("command", [("status",), ("reset", "k")])
def test_the_acl_line_suggested_to_an_operator_without_scan_is_the_one_that_works(
    server: RedisServer, limiter: Limiter, command: tuple[str, ...]
) -> None:
    """``status`` and ``reset`` scan the prefix: a user with the workers' ACL line (no
    ``+scan``) is refused, and the line the error suggests, once run, lets it through."""
    admin = server.client()
    workers_line = _failures.acl_setuser("ops", "example").replace(">PASSWORD", ">pw")
    admin.execute_command(*workers_line.split())
    limiter.acquire("k", "10/s")
    url = f"redis://ops:pw@127.0.0.1:{server.port}/0"
    where = ("--url", url, "--prefix", "example")
    refused = run(sys.executable, "-m", "celery_ratelimit", *command, *where, env={})
    assert refused.returncode == 1, refused.stdout + refused.stderr
    suggested = re.search(r"ACL SETUSER ops on >PASSWORD [^(]*", refused.stderr)
    assert suggested and "+scan" in suggested[0].split(), refused.stderr
    admin.execute_command(*suggested[0].replace(">PASSWORD", ">pw").split())
    assert "example" in cli(*command, *where, env={})
    admin.close()


def test_the_demo_verdict_is_by_starts_and_says_by_how_much_and_why() -> None:
    from celery_ratelimit._tools.demo import Report

    rate = Rate.parse("2/s")
    # three bodies start within one second although no two grants share a window: the
    # first one started 600 ms after its grant
    runs = [(1_600_000, 1_000_000, 0), (2_050_000, 2_050_000, 1), (2_100_000, 2_100_000, 1)]
    exceeded = Report(3, 3, rate, 2, 3, 1.1, 1.0, 6, 2, runs)
    ok, line = exceeded.verdict()
    assert not ok
    assert "3 starts in one window of 1s, 1 over the limit of 2" in line
    assert "the grants held (2)" in line and "600 ms after its grant" in line
    held = Report(3, 3, rate, 2, 2, 1.1, 1.0, 6, 2, [*runs[1:], (3_000_000, 3_000_000, 1)])
    assert held.verdict() == (
        True,
        "the shared limit held: no window saw more task starts than the limit",
    )
    assert not Report(3, 2, rate, 2, 2, 1.1, 1.0, 6, 2, runs[1:]).verdict()[0]


def test_a_demo_whose_tasks_all_fit_one_window_says_so_rather_than_a_ratio() -> None:
    from celery_ratelimit._tools.demo import Report

    report = Report(5, 5, Rate.parse("10/s"), 5, 5, 0.02, 0.0, 8, 0, [])
    line = next(one for one in report.lines() if one.startswith("drain time / ideal"))
    assert line.endswith("0.02s / 0.00s (the limit lets every task start at once)"), line


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is not None, reason="needs matplotlib absent"
)
def test_demo_plot_without_matplotlib_is_refused_before_anything_starts() -> None:
    started = time.monotonic()
    result = run(
        sys.executable, "-m", "celery_ratelimit", "demo", "--tasks", "20", "--plot", "x.png",
        env={}, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "--plot needs matplotlib: pip install matplotlib" in result.stderr
    assert "sending" not in result.stdout and time.monotonic() - started < 30


def test_status_and_explain_show_running_bodies_waiters_and_a_pause(
    server: RedisServer, env: dict[str, str]
) -> None:
    """A concurrency limit's row says how many bodies run and how many wait; a paused
    key is listed with the time left; explain says the call waits for the pause."""
    erp = "examples.erp_sync"
    limiter = Limiter.from_url(server.url, prefix="example-erp")
    one = [Concurrency(1, key="acme:erp")]
    assert limiter.acquire("x", one).allowed
    assert limiter.acquire("x", one, reserve=True).reserved
    limiter.pause("erp", 30)
    out = cli("status", "-A", erp, env=env)
    acme = row(out, "acme:erp")
    assert acme[1:7] == ["-", "conc", "1/1", "running", "0", "1"]
    assert "{tenant}:erp@1 at once" in out
    assert 0 < seconds_after(out, "paused erp: nothing is granted; the pause ends") <= 30
    out = cli("explain", "-A", erp, f"{erp}.sync_page", "acme", "1", env=env)
    assert "1. erp@20/s" in out or "erp@20/s" in out
    assert "{tenant}:erp@1 at once  (at most 1 running at once)" in out
    assert "now        1 running, 1 waiting for a turn" in out
    assert 0 < seconds_after(out, "paused erp: nothing is granted; the pause ends") <= 30
    assert "decision  denied by a pause of its key (an upstream's 429)" in out
    limiter.client.close()


def test_pause_and_resume_by_both_command_lines(
    server: RedisServer, limiter: Limiter, env: dict[str, str]
) -> None:
    """``pause KEY SECONDS`` stops every grant on the key; ``resume KEY`` ends it at once
    for new calls and says how much was left (a call deferred past the pause keeps its
    slot); a second resume says there was no pause."""
    search = Limit(SEARCH)
    out = cli("pause", "yt:search:key1", "30", "--url", server.url, "--prefix", "example", env=env)
    assert (
        out.strip() == "yt:search:key1: paused on every worker, nothing is granted on it for 30.0s"
    )
    assert 29 < limiter.peek("yt:search:key1", search).retry_after <= 30
    # a task deferred during the pause: its slot is placed past it
    deferred = limiter.acquire("yt:search:key1", search, reserve=True, horizon=60)
    assert deferred.reserved and 29 < deferred.retry_after <= 31
    result = run(CELERY, "-A", APP, "ratelimit", "resume", "yt:search:key1", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("yt:search:key1: resumed (")
    assert limiter.peek("yt:search:key1", search).allowed  # new calls are free again
    # the README's "tasks deferred past the pause keep those slots": not started earlier
    kept = limiter.confirm(deferred.token, "yt:search:key1", search, horizon=60)
    assert not kept.allowed and kept.reserved and kept.retry_after > 25, kept
    assert cli("resume", "yt:search:key1", "-A", APP, env=env).strip() == (
        "yt:search:key1: was not paused"
    )
    bad = run(sys.executable, "-m", "celery_ratelimit", "pause", "k", "soon", "-A", APP, env=env)
    assert bad.returncode == 1 and bad.stderr.startswith("error: not a Retry-After value")


def test_set_and_unset_change_what_every_decision_grants(
    server: RedisServer, limiter: Limiter, env: dict[str, str]
) -> None:
    """``set KEY RATE`` (Celery's CLI and ours) takes effect at the next decision and
    shows in status; ``unset`` gives the declared rate back; a bad rate is refused by name."""
    populate(limiter)  # the search cap full (25/25) with one slot reserved
    search = Limit(SEARCH)
    assert not limiter.acquire("yt:search:key1", search).allowed
    result = run(
        CELERY, "-A", APP, "ratelimit", "set", "yt:search:key1", "30/25s", "--ttl", "600", env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "yt:search:key1: 30/25s on every worker" in result.stdout
    out = cli("status", "-A", APP, env=env)
    assert row(out, "yt:search:key1")[1:6] == ["25s", "log", "25/30", "4", "1"]
    assert "overridden: 30/25s" in out
    assert 0 < seconds_after(out, "override yt:search:key1: 30/25s (ends") <= 600
    # 25 grants and a slot reserved where the first grant leaves: 5 more fit every window
    # now (the status's 4 left counts the reservation as if it were in the window now)
    assert [limiter.acquire("yt:search:key1", search).allowed for _ in range(6)] == [True] * 5 + [
        False
    ]
    out = cli("unset", "yt:search:key1", "--url", server.url, "--prefix", "example", env=env)
    assert "yt:search:key1: override 30/25s removed" in out
    assert "override" not in cli("status", "-A", APP, env=env)
    assert not limiter.acquire("yt:search:key1", search).allowed
    # a second unset says there was nothing to remove, on either command line
    out = cli("unset", "yt:search:key1", "-A", APP, env=env)
    assert "yt:search:key1: there was no override to remove" in out
    result = run(CELERY, "-A", APP, "ratelimit", "unset", "yt:search:key1", env=env)
    assert "there was no override to remove" in result.stdout, result.stdout + result.stderr
    bad = run(
        sys.executable, "-m", "celery_ratelimit", "set", "k", "10/fortnight", "-A", APP, env=env
    )
    assert bad.returncode != 0 and "10/fortnight" in bad.stderr
    bad = run(CELERY, "-A", APP, "ratelimit", "set", "k", "0/s", env=env)
    assert bad.returncode != 0 and "0" in bad.stderr and "Traceback" not in bad.stderr


def test_explain_refuses_arguments_that_do_not_fit_the_tasks_signature(
    env: dict[str, str],
) -> None:
    """Even where no key depends on the arguments (a rule's key is the task's name),
    a call Celery would refuse is reported as such, not "allowed now"."""
    app = "examples.existing_project"
    task = f"{app}.tasks.send_email"
    explain = (sys.executable, "-m", "celery_ratelimit", "explain", "-A", app, task)
    result = run(*explain, "a@example.com", "extra", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error     Celery would refuse this call" in result.stdout
    assert "too many positional arguments" in result.stdout
    assert "allowed now" not in result.stdout
    result = run(*explain, "--kwargs", '{"nobody": 1}', env=env)
    assert result.returncode == 1 and "send_email(" in result.stdout
    assert "allowed now" not in result.stdout
    # the same through Celery's own command line
    result = run(CELERY, "-A", app, "ratelimit", "explain", task, env=env)
    assert result.returncode == 1 and "missing a required argument" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_a_redis_url_error_names_the_option_it_came_from(
    server: RedisServer, env: dict[str, str]
) -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"
    wrong_password = f"redis://nobody:secret@127.0.0.1:{server.port}/0"
    ours = (sys.executable, "-m", "celery_ratelimit")
    for command in (
        (*ours, "status", "--url", closed),
        (*ours, "set", "k", "5/s", "--url", wrong_password),
        (*ours, "unset", "k", "-A", APP, "--url", closed),
        (CELERY, "-A", APP, "ratelimit", "reset", "k", "--url", wrong_password),
        (*ours, "status", "--url", "http://127.0.0.1/0"),
    ):
        result = run(*command, env=env)
        assert result.returncode != 0, command
        assert "--url" in result.stderr and "ratelimit_redis_url" not in result.stderr, (
            command,
            result.stderr,
        )
        assert "secret" not in result.stdout + result.stderr
    # the app's URL, when no --url is given, is named as the app's setting
    result = run(*ours, "status", "-A", APP, env={**env, "RATELIMIT_REDIS_URL": closed})
    assert result.returncode != 0 and "from ratelimit_redis_url" in result.stderr, result.stderr
    assert "--url" not in result.stderr
