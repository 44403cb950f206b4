"""Real ``celery worker`` nodes for the tests, and what to read back from them.

``Nodes`` starts N worker processes of ``tests.apps.nodes`` (prefork, concurrency 2),
each in its own process group with its log in a file, waits until every one of them
logged ``ready.``, and at ``stop()`` kills the whole group, so no pool child outlives
the test. The app's tasks append one JSON record per execution to ``{prefix}:runs``
on the limiter's Redis; ``runs()`` reads them back and the functions below compute
the numbers the tests assert on.

All times here are microseconds of the limiter's Redis clock (``TIME``), never a
worker's clock.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.apps.nodes"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
READY_TIMEOUT = 120.0


def unique_prefix(name: str) -> str:
    """A key prefix unique to one test (letters, digits and dashes only)."""
    base = "".join(c if c.isalnum() else "-" for c in name)[:40].strip("-")
    return f"crl-{base}-{uuid.uuid4().hex[:6]}"


def rabbitmq_reachable(host: str = "127.0.0.1", port: int = 5672) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def require_rabbitmq() -> None:
    """Skip unless RabbitMQ answers on 127.0.0.1:5672 (fail if CRL_REQUIRE_RABBITMQ=1)."""
    if rabbitmq_reachable():
        return
    reason = "RabbitMQ is not reachable at 127.0.0.1:5672"
    if os.environ.get("CRL_REQUIRE_RABBITMQ") == "1":
        pytest.fail(f"{reason}, and CRL_REQUIRE_RABBITMQ=1 requires it")
    pytest.skip(f"{reason} (set CRL_REQUIRE_RABBITMQ=1 to fail instead of skipping)")


@contextmanager
def stopped_on_failure(stop: Callable[[], None]) -> Iterator[None]:
    """Run the block (a wait for nodes just started); if it fails, or is interrupted,
    ``stop`` them all first: no worker outlives a start that did not finish."""
    try:
        yield
    except BaseException:
        stop()
        raise


@dataclass
class Nodes:
    """N worker nodes sharing one broker and one limiter Redis.

    Args:
        logdir: where each node's log file goes.
        limiter_url: the limiter's Redis (``CRL_REDIS``); the runs list lives there too.
        broker_url, backend_url: Celery broker and result backend (``None``: no backend).
        prefix: the limiter's key prefix, unique per test.
        rate: ``CRL_RATE``, the rate of the tasks that read it.
        reserve: ``CRL_RESERVE``: deferrals reserve a slot (True) or compete again.
        queue: the default queue name (``CRL_QUEUE``).
    """

    logdir: Path
    limiter_url: str
    broker_url: str
    backend_url: str | None = None
    prefix: str = "crl"
    rate: str = "10/s"
    reserve: bool = True
    queue: str = "celery"
    count: int = 3
    #: the worker pool (``-P``) and its concurrency (``-c``)
    pool: str = "prefork"
    concurrency: int = 2
    #: more environment variables for the nodes (``CELERY_RATELIMIT_PUBLIC_ONLY``)
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    _client: Celery | None = None

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CRL_BROKER=self.broker_url,
            CRL_BACKEND=self.backend_url or "",
            CRL_REDIS=self.limiter_url,
            CRL_PREFIX=self.prefix,
            CRL_RATE=self.rate,
            CRL_RESERVE="1" if self.reserve else "0",
            CRL_QUEUE=self.queue,
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        )
        env.update(self.extra_env)
        return env

    def start(self) -> Nodes:
        """Start every node and wait until each logged ``ready.``.

        Raises:
            RuntimeError: a node exited or was not ready within ``READY_TIMEOUT``
                (its log is in the message).
        """
        self.logdir.mkdir(parents=True, exist_ok=True)
        env = self.env
        for k in range(1, self.count + 1):
            log = self.logdir / f"node{k}.log"
            cmd = [
                sys.executable, "-m", "celery", "-A", APP, "worker",
                "-P", self.pool, "-c", str(self.concurrency),
                "-n", f"node{k}-{self.prefix}@%h", "-Q", self.queue,
                "--without-gossip", "--without-mingle", "--without-heartbeat",
                "-l", "INFO",
            ]  # fmt: skip
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            self.procs.append(proc)
            self.logs.append(log)
        with stopped_on_failure(self.stop):
            self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        pending = set(range(len(self.procs)))
        while pending:
            for i in list(pending):
                if b" ready." in self.logs[i].read_bytes():
                    pending.discard(i)
                elif self.procs[i].poll() is not None:
                    raise RuntimeError(f"worker node{i + 1} exited:\n{self.log_text(i)}")
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    "worker nodes not ready in time:\n"
                    + "\n".join(self.log_text(i) for i in sorted(pending))
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop every node: SIGTERM, a moment's grace, then SIGKILL to each process group
        (the test is over: a warm shutdown takes a second or more and shows nothing)."""
        # results still referenced by a cycle unsubscribe when collected: let them do
        # it now, while the backend's redis-server is still up
        gc.collect()
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 0.3
        for proc in self.procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            # the pool children share the group; none may outlive the test
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self.procs.clear()
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- logs -------------------------------------------------------------------

    def log_text(self, i: int, since: int = 0, tail: int = 200) -> str:
        """The last ``tail`` lines of node ``i``'s log written after byte ``since``."""
        data = self.logs[i].read_bytes()[since:].decode("utf-8", "replace")
        lines = data.splitlines()[-tail:]
        return f"===== {self.logs[i].name} =====\n" + "\n".join(lines)

    def log_marks(self) -> list[int]:
        return [log.stat().st_size for log in self.logs]

    def logs_since(self, marks: Sequence[int]) -> str:
        return "\n".join(self.log_text(i, mark) for i, mark in enumerate(marks))

    def grep(self, text: str) -> list[str]:
        """Every log line (of every node) containing ``text``."""
        found: list[str] = []
        for log in self.logs:
            found += [
                line for line in log.read_text("utf-8", "replace").splitlines() if text in line
            ]
        return found

    # -- talking to the nodes ---------------------------------------------------

    @property
    def client(self) -> Celery:
        """A producer app on the same broker and backend (the test process's side)."""
        if self._client is None:
            app = Celery("producer", broker=self.broker_url, backend=self.backend_url or None)
            app.conf.task_default_queue = self.queue
            app.conf.broker_connection_retry_on_startup = True
            # a result collected after the test stopped the backend's redis-server must
            # not retry reconnecting for a minute (AsyncResult.__del__ unsubscribes)
            app.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 0}}
            self._client = app
        return self._client

    def send(self, name: str, *args: Any, **options: Any) -> Any:
        """Publish task ``tests.apps.nodes.<name>`` with ``args``; returns its AsyncResult."""
        return self.client.send_task(f"{APP}.{name}", args=args, **options)

    def signature(self, name: str, *args: Any, **options: Any) -> Any:
        return self.client.signature(f"{APP}.{name}", args=args, **options)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.limiter_url)

    def runs(self) -> list[dict[str, Any]]:
        """Every execution recorded so far (oldest first)."""
        with self.redis() as client:
            return [json.loads(raw) for raw in client.lrange(f"{self.prefix}:runs", 0, -1)]

    def ends(self) -> list[dict[str, Any]]:
        """When each body that notes its end (``finish``) ended, oldest first."""
        with self.redis() as client:
            return [json.loads(raw) for raw in client.lrange(f"{self.prefix}:ends", 0, -1)]

    def clear_runs(self) -> None:
        """Forget the records (runs, ETA holds, ends) and the upstream's one 429."""
        with self.redis() as client:
            client.delete(*(f"{self.prefix}:{name}" for name in ("runs", "held", "ends", "429")))

    def ensure_running(self) -> None:
        """Start the nodes again (fresh logs) if one of them exited, so that a test
        sharing them never inherits a node an earlier test lost."""
        if self.procs and all(proc.poll() is None for proc in self.procs):
            return
        self.stop()
        self.logs.clear()
        self.start()

    def held(self) -> list[float]:
        """Seconds each ETA message received so far was held before it was due."""
        with self.redis() as client:
            return [json.loads(raw)["ahead"] for raw in client.lrange(f"{self.prefix}:held", 0, -1)]

    def clear_budgets(self) -> None:
        """Forget every budget under the prefix, so a test does not start behind the
        previous test's entries (which stay in their windows for a while)."""
        with self.redis() as client:
            for key in client.scan_iter(f"{self.prefix}:{{*"):
                client.delete(key)

    def wait_for_runs(
        self, ids: Iterable[str], timeout: float, settle: float = 0.5
    ) -> list[dict[str, Any]]:
        """Records of ``ids`` once every one has run (then ``settle`` s more, to catch a
        duplicate), or whatever ran by ``timeout``."""
        return wait_for_records(self.runs, ids, timeout, settle)


def wait_for_records(
    read: Callable[[], list[dict[str, Any]]],
    ids: Iterable[str],
    timeout: float,
    settle: float = 0.5,
) -> list[dict[str, Any]]:
    """The records ``read()`` returns for ``ids`` once every id is among them (then
    ``settle`` s more, to catch a duplicate), or whatever is there by ``timeout``."""
    wanted = set(ids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if {r["id"] for r in read()} >= wanted:
            time.sleep(settle)
            break
        time.sleep(0.1)
    return [r for r in read() if r["id"] in wanted]


# -- numbers from the records ---------------------------------------------------------


def evalsha_calls(client: redis.Redis) -> int:
    """Successful EVALSHA/EVAL calls the server has answered since its last stats reset."""
    stats = client.info("commandstats")
    calls = 0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        row = stats.get(name) or {}
        calls += int(row.get("calls", 0)) - int(row.get("failed_calls", 0))
    return calls


@contextmanager
def node_set(
    logdir: Path,
    prefix: str,
    *,
    broker_url: str | None = None,
    backend: bool = True,
    separate_limiter: bool = False,
    **options: Any,
) -> Iterator[Nodes]:
    """Private redis-server(s) plus started ``Nodes``; everything is stopped on exit.

    The broker is db 1 and the result backend db 2 of one private redis-server (unless
    ``broker_url`` names another broker); the limiter is db 0 of the same server, or of
    a second one when ``separate_limiter`` (so that its command statistics count the
    limiter's scripts only: kombu's Redis transport runs Lua scripts of its own).
    """
    servers = [RedisServer()]
    try:
        if separate_limiter:
            servers.append(RedisServer())
        main, limiter = servers[0], servers[-1]
        nodes = Nodes(
            logdir,
            limiter_url=f"redis://127.0.0.1:{limiter.port}/0",
            broker_url=broker_url or f"redis://127.0.0.1:{main.port}/1",
            backend_url=f"redis://127.0.0.1:{main.port}/2" if backend else None,
            prefix=prefix,
            **options,
        )
        nodes.start()
        try:
            yield nodes
        finally:
            nodes.stop()
    finally:
        for server in servers:
            server.close()
