"""Worker nodes of ``tests.apps.faults`` for the fault tests, one process group each.

Unlike ``tests.nodes`` (a fixed set of identical nodes), each node here is started on
its own, with its own environment and an optional command prefix (``faketime``), and
can be killed alone (the whole node, or one pool process) in the middle of a run.
Executions are recorded on a plain Redis (``CRL_RUNS``) so that breaking the limiter's
Redis never loses the record.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from tests.measure import max_in_window
from tests.nodes import stopped_on_failure, wait_for_records

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.apps.faults"
READY_TIMEOUT = 120.0


@dataclass
class Node:
    """One ``celery worker`` node (prefork unless ``pool``) in its own process group."""

    name: str
    env: dict[str, str]
    log: Path
    concurrency: int = 2
    wrapper: Sequence[str] = ()
    pool: str = "prefork"
    app: str = APP
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Node:
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        cmd = [
            *self.wrapper, sys.executable, "-m", "celery", "-A", self.app, "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-n", f"{self.name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        return self

    def wait_ready(self, since: int = 0) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while b" ready." not in self.log.read_bytes()[since:]:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def pool_pids(self) -> list[int]:
        """Process ids of this node's pool children."""
        if self.proc is None:
            return []
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        )
        return [int(p) for p in out.stdout.split()]

    @property
    def hostname(self) -> str:
        """The node's name as Celery's remote control addresses it."""
        return f"{self.name}@{socket.gethostname()}"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole node (main process and pool children)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 5) -> None:
        """SIGTERM, up to ``grace`` seconds for the warm shutdown, then SIGKILL to the
        process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # no pool child may outlive the test
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.proc = None

    def held(self) -> set[str]:
        """Ids of the tasks this node received and has not finished, by its log: bodies
        running, prefetched messages, deferred copies waiting for their ETA."""
        balance: Counter[str] = Counter()
        for line in self.text().splitlines():
            if (match := _TASK_LINE.search(line)) is None:
                continue
            task_id, what = match.groups()
            balance[task_id] += 1 if what == "received" else -1
        return {task_id for task_id, n in balance.items() if n > 0}

    def unread_bytes(self, port: int) -> list[int]:
        """Bytes the kernel has received and the node's main process has not read yet, on
        each of its TCP connections to ``port`` (Linux: ``/proc``). A ``BRPOP`` reply
        waiting there holds a message already popped from the broker's list."""
        if self.proc is None:
            return []
        inodes = set()
        for fd in Path(f"/proc/{self.proc.pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
        unread = []
        for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
            for row in table.read_text().splitlines()[1:] if table.exists() else []:
                # sl local rem st tx_queue:rx_queue tr:when retrnsmt uid timeout inode
                cols = row.split()
                if cols[9] in inodes and int(cols[2].rsplit(":", 1)[1], 16) == port:
                    unread.append(int(cols[4].split(":")[1], 16))
        return unread

    def text(self) -> str:
        return self.log.read_text("utf-8", "replace")

    def grep(self, needle: str) -> list[str]:
        return [line for line in self.text().splitlines() if needle in line]


@dataclass
class Fleet:
    """Nodes sharing one broker, one limiter URL and one runs Redis."""

    logdir: Path
    broker_url: str
    limiter_url: str
    runs_url: str
    prefix: str
    queue: str = "celery"
    settings: dict[str, str] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    _producer: Celery | None = None

    def add(
        self,
        count: int = 1,
        *,
        wrapper: Sequence[str] = (),
        env: dict[str, str] | None = None,
        pool: str = "prefork",
        **settings: str,
    ) -> list[Node]:
        """Start ``count`` more nodes on ``pool`` (``CRL_*`` settings as keywords, other
        variables in ``env``, a command prefix such as ``faketime`` in ``wrapper``); wait
        for them."""
        self.logdir.mkdir(parents=True, exist_ok=True)
        env = {
            **(env or {}),
            "CRL_BROKER": self.broker_url,
            "CRL_REDIS": self.limiter_url,
            "CRL_RUNS": self.runs_url,
            "CRL_PREFIX": self.prefix,
            "CRL_QUEUE": self.queue,
            **{f"CRL_{k.upper()}": v for k, v in {**self.settings, **settings}.items()},
        }
        added = []
        for _ in range(count):
            name = f"node{len(self.nodes) + 1}-{self.prefix}"
            node = Node(name, env, self.logdir / f"{name}.log", wrapper=wrapper, pool=pool)
            self.nodes.append(node.start())
            added.append(node)
        with stopped_on_failure(self.stop):
            for node in added:
                node.wait_ready()
        return added

    def stop(self) -> None:
        """Stop every node, the test being over: SIGTERM to all at once, a moment's grace,
        then SIGKILL (a warm shutdown takes a second or more and shows nothing)."""
        for node in self.nodes:
            node.kill(signal.SIGTERM)
        deadline = time.monotonic() + 0.3
        for node in self.nodes:
            node.stop(grace=max(0.0, deadline - time.monotonic()))
        if self._producer is not None:
            self._producer.close()
            self._producer = None

    @property
    def producer(self) -> Celery:
        if self._producer is None:
            self._producer = Celery("producer", broker=self.broker_url)
            self._producer.conf.broker_connection_retry_on_startup = True
            options: dict[str, Any] = {}
            if "master_name" in self.settings:
                options["master_name"] = self.settings["master_name"]
            if self.settings.get("confirm"):
                # the nodes' publisher confirms (tests.apps.faults), the producer's too
                options["confirm_publish"] = True
            if options:
                self._producer.conf.broker_transport_options = options
        return self._producer

    def send(self, name: str, *args: Any, **options: Any) -> str:
        """Publish ``tests.apps.faults.<name>(*args)``; returns the task id."""
        options.setdefault("queue", self.queue)
        return str(self.producer.send_task(f"{APP}.{name}", args=args, **options).id)

    def runs(self) -> list[dict[str, Any]]:
        with redis.Redis.from_url(self.runs_url) as client:
            return [json.loads(raw) for raw in client.lrange(f"{self.prefix}:runs", 0, -1)]

    def wait_for_runs(
        self, ids: Iterable[str], timeout: float, settle: float = 0.5
    ) -> list[dict[str, Any]]:
        """Start records of ``ids`` once every one ran (``settle`` s more to catch a
        duplicate), or whatever ran by ``timeout``."""

        def starts() -> list[dict[str, Any]]:
            return [r for r in self.runs() if not r.get("done")]

        return wait_for_records(starts, ids, timeout, settle)

    def grep(self, needle: str) -> list[str]:
        return [line for node in self.nodes for line in node.grep(needle)]

    def logs(self, tail: int = 4000) -> str:
        return "\n".join(f"===== {n.name} =====\n{n.text()[-tail:]}" for n in self.nodes)


def tally(ids: Sequence[str], runs: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Tasks sent, distinct tasks run, lost (never ran) and duplicated (ran twice+)."""
    counts = Counter(r["id"] for r in runs)
    return {
        "sent": len(ids),
        "run": len(counts),
        "lost": len(set(ids) - set(counts)),
        "duplicated": sum(1 for n in counts.values() if n > 1),
        "executions": len(runs),
    }


def print_on_failure(request: Any, fleet: Fleet) -> None:
    """Print the nodes' logs at teardown when the test failed."""
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.passed:
        print(fleet.logs())


def max_grants(runs: Iterable[dict[str, Any]], window_us: int) -> int:
    """Most grants (limiter's Redis clock) in any window ``(t - W, t]``."""
    return max_in_window([r["granted"] for r in runs if r["granted"] is not None], window_us)


_TASK_LINE = re.compile(r"\] Task \S+\[([0-9a-f-]+)\] (received|succeeded|retry|raised)")
_DEFERRED = re.compile(r"ratelimit: deferred \S+\[([0-9a-f-]+)\]")


_DEFERRED_FOR = re.compile(
    r"^\[(\S+ \S+): .*ratelimit: deferred \S+\[([0-9a-f-]+)\] key \S+ for ([0-9.]+)s"
)


def _deferrals(lines: Iterable[str]) -> Iterator[tuple[str, float, float]]:
    """(task id, when the copy was published, its countdown) per ``deferred`` line."""
    for line in lines:
        if match := _DEFERRED_FOR.search(line):
            stamp, task_id, countdown = match.groups()
            logged = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            yield task_id, logged, float(countdown)


def due_times(lines: Iterable[str]) -> dict[str, float]:
    """When each deferred task's newest copy is due (epoch seconds, by the log's clock)."""
    due: dict[str, float] = {}
    for task_id, logged, countdown in _deferrals(lines):
        due[task_id] = max(due.get(task_id, 0.0), logged + countdown)
    return due


def deferred_ids(lines: Iterable[str]) -> set[str]:
    """Task ids named by ``ratelimit: deferred`` log lines."""
    return {m.group(1) for line in lines if (m := _DEFERRED.search(line))}
