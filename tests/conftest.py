from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

# Imported at collection, before any test starts a thread: hypothesis loads this module
# lazily, inside a test, where pytest's assertion rewriting parses it; CPython 3.11's
# AST constructor keeps one recursion counter for all threads, and a parse beside another
# thread's fails with "SystemError: AST constructor recursion depth mismatch".
import hypothesis.internal.conjecture.optimiser  # noqa: F401
import pytest
import redis

from celery_ratelimit import Limiter
from tests.nodes import Nodes, node_set, unique_prefix
from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for the whole session (tests may restart it)."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    """``REDIS_URL`` if set, else the private server's URL."""
    return os.environ.get("REDIS_URL") or redis_server.url


@pytest.fixture
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    """Two private redis-servers for one test: a broker (which also keeps the execution
    records) and the limiter's Redis."""
    broker, limiter = RedisServer(), RedisServer()
    yield broker, limiter
    broker.close()
    limiter.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def limiter(redis_url: str, request: pytest.FixtureRequest) -> Iterator[Limiter]:
    """A limiter whose keys live under a prefix unique to the test."""
    prefix = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    lim = Limiter.from_url(redis_url, prefix=prefix)
    yield lim
    for key in lim.client.scan_iter(f"{prefix}:*"):
        lim.client.delete(key)
    lim.client.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[object]:
    """Keep each phase's report on the item (``item.rep_call``), so that fixtures can
    tell at teardown whether the test failed (the worker-node fixtures then print the
    nodes' logs)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def session_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    """Three nodes with ``node_set``'s defaults (prefork -c 2, ``CRL_RATE`` 10/s, a
    private Redis as broker, result backend and limiter), started once for every test
    that needs no other option: each start of a node set costs seconds."""
    with node_set(
        tmp_path_factory.mktemp("session-nodes"), unique_prefix("session-nodes")
    ) as nodes:
        yield nodes


@pytest.fixture
def shared_nodes(session_nodes: Nodes, request: pytest.FixtureRequest) -> Iterator[Nodes]:
    """The session's default nodes, every node running, with no record and no key of an
    earlier test (runs, budgets, pauses, overrides); their logs printed on failure."""
    session_nodes.ensure_running()
    session_nodes.clear_runs()
    session_nodes.clear_budgets()
    marks = session_nodes.log_marks()
    yield session_nodes
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.passed:
        print(session_nodes.logs_since(marks))


@pytest.fixture
def start_nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Nodes]]:
    """Start a node set of the test's own (``node_set`` keywords); stopped at teardown,
    logs printed on failure. A test content with the defaults takes ``shared_nodes``."""
    started: list[Nodes] = []
    with ExitStack() as stack:

        def start(**options: Any) -> Nodes:
            prefix = unique_prefix(request.node.name)
            nodes = stack.enter_context(
                node_set(tmp_path / f"set{len(started)}", prefix, **options)
            )
            started.append(nodes)
            return nodes

        yield start
        report = getattr(request.node, "rep_call", None)
        if report is None or not report.passed:
            for nodes in started:
                print(nodes.logs_since([0] * len(nodes.logs)))
