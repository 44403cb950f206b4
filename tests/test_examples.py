"""Each example in examples/ runs as a user would run it: private redis-servers, real
``celery worker`` nodes, the example's own entry point; its report is checked."""

from __future__ import annotations

import re
import sys
from contextlib import nullcontext

import pytest

from tests import minute_clock
from tests.examples_env import ROOT, env_for, run, workers
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.celery


def run_example(module: str, env: dict[str, str], *args: str) -> str:
    """Run ``python -m <module> [args]`` against two ``celery worker`` nodes of it; its
    output, once it exited 0."""
    with workers(module, env, count=2):
        result = run(sys.executable, "-m", module, *args, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def run_quota_example(
    servers: tuple[RedisServer, RedisServer], window: str, minute_soon: bool = False, **env: str
) -> tuple[str, list[int]]:
    """Run the quota example on two workers: its output, and the units it reports
    spent in each window (lines starting with ``window``), checked to be 10,560 in all
    (8 regions x (13 x 100 + 20 x 1): more than one window's 9,500) and 9,500 at most
    in each. ``minute_soon``: the limiter's Redis is instead a server whose next
    minute starts seconds after the run does (tests/minute_clock.py), started once the
    workers are up."""
    full = env_for(*servers, YT_SEARCHES="13", YT_PAGES="20", **env)
    port = free_port()
    if minute_soon:
        full["RATELIMIT_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    with (
        workers("examples.quota_ingestion", full, count=2),
        minute_clock.minute_soon(port) if minute_soon else nullcontext(),
    ):
        result = run(sys.executable, "-m", "examples.quota_ingestion", env=full)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "executed 104 search.list x 100 + 160 videos.list x 1 = 10560 units" in out
    spent = [int(u) for u in re.findall(rf"^{window} .*?(\d+) units spent", out, re.M)]
    assert sum(spent) == 10560 and len(spent) >= 2
    assert all(units <= 9500 for units in spent)
    return out, spent


def test_quota_ingestion_spends_at_most_the_quota_per_sliding_day(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    out, _ = run_quota_example(servers, "day", YT_DAY_SECONDS="3")
    most = int(re.search(r"most units in any sliding day\s+(\d+) / 9500", out)[1])  # type: ignore[index]
    assert 0 < most <= 9500  # the quota held (how close to it a run gets moves with load)
    cap = int(re.search(r"most search.list in any sliding hour (\d+) / 25", out)[1])  # type: ignore[index]
    assert cap <= 25
    assert "result: the quota held" in out


def test_per_tenant_api_keeps_each_tenant_within_its_own_limit(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    env = env_for(*servers, TENANT_RATE="5/s", TENANT_CALLS="8")
    out = run_example("examples.per_tenant_api", env, "produce")
    rows = re.findall(
        r"^(\w+)\s+(\d+) calls in\s+([\d.]+)s, most in any window (\d+) \(limit 5\)",
        out,
        re.M,
    )
    assert {r[0]: int(r[1]) for r in rows} == {"acme": 24, "globex": 8, "initech": 8}
    for tenant, _calls, _span, most in rows:
        assert int(most) <= 5, tenant
    spans = {r[0]: float(r[2]) for r in rows}
    # the noisy tenant waits for its own budget (24 calls at 5/s: at least 3.8 s) ...
    assert spans["acme"] >= 3.8
    # ... while the others are not held up behind it (8 calls at 5/s: one window more)
    assert spans["globex"] < spans["acme"] and spans["initech"] < spans["acme"]
    assert "every tenant stayed within its limit" in out


def test_erp_sync_holds_one_session_per_tenant_and_honours_the_erps_429s(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    env = env_for(*servers, ERP_PORT=str(free_port()), ERP_PAGES="6", ERP_BUSY_EVERY="7")
    out = run_example("examples.erp_sync", env, "produce")
    assert "pages synced                     18 of 18" in out
    assert "most open sessions of one tenant 1 (the ERP allows 1)" in out
    refused = int(re.search(r"429s answered\s+(\d+)", out)[1])  # type: ignore[index]
    assert refused >= 1
    assert "requests while the ERP was busy  0" in out
    assert "result: the ERP's limits held" in out


def test_llm_budget_follows_what_the_llm_reports(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    env = env_for(*servers, LLM_PORT=str(free_port()), LLM_PROMPTS="24")
    out = run_example("examples.llm_budget", env, "produce")
    assert "prompts answered                 24 of 24" in out
    assert "answered twice                   0" in out
    assert re.search(r"429s answered\s+\d+", out)
    assert "result: every prompt answered once" in out


def test_existing_project_gets_rules_without_touching_its_tasks(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    source = (ROOT / "examples" / "existing_project" / "tasks.py").read_text()
    assert "celery_ratelimit" not in source and "ratelimit" not in source
    env = env_for(*servers)
    out = run_example("examples.existing_project", env)
    billing = re.search(r"billing:api \(sync_\*\)\s+(\d+) runs, most in any second (\d+)", out)
    email = re.search(r"send_email\s+(\d+) runs, most in any second (\d+)", out)
    assert billing and email, out
    assert int(billing[1]) == 12 and 1 <= int(billing[2]) <= 4  # both tasks, one budget of 4/s
    assert int(email[1]) == 6 and 1 <= int(email[2]) <= 2
    assert "the rules held" in out


def test_quota_ingestion_on_the_pacific_clock_spends_at_most_the_quota_per_window(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    """The quota as the API counts it, a calendar window of the Pacific clock (a minute
    here, standing for the day): every window holds at most 9,500 units. Its next
    minute starts seconds after the run does, where faketime allows; else the run waits
    for the real clock's (up to a minute)."""
    soon = minute_clock.binary() is not None
    out, _ = run_quota_example(servers, "minute", minute_soon=soon, YT_CALENDAR="minute")
    assert "result: the quota held" in out
