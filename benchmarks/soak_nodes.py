"""The soak's worker nodes and their supervisor (``benchmarks.soak``): three ``celery
worker`` nodes, started again when a scheduled fault kills them or when they exit on
their own (as systemd would), and probed (as a Kubernetes liveness probe would, ``celery
inspect ping``): a node that stops answering pings is killed -9 and started again.
Celery 5.7 can leave a node up and deaf after the Redis broker's restart (its
``Unrecoverable error ... 'hostname'``, docs/operations.md): without the probe, such a
node holds its messages for good.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from celery import Celery

from benchmarks.soak_faults import Fault
from tests.fault_nodes import READY_TIMEOUT, Node

APP = "benchmarks.soak_app"
#: name, pool, concurrency
NODES = [("node1", "prefork", 2), ("node2", "threads", 4), ("node3", "gevent", 8)]
#: seconds a node has to exit after SIGTERM before it counts as hung
TERM_GRACE = 60.0
#: the supervisor's liveness probe: a ping of every node this often (seconds), each
#: answer awaited this long; a node that misses this many pings in a row is hung, and
#: is killed -9 and started again (a ping missed while the broker is down, stopped or
#: has its connections cut, or within ``PROBE_SETTLE`` s after, does not count)
PROBE_EVERY = 15.0
PROBE_TIMEOUT = 8.0
PROBE_MISSES = 3
PROBE_SETTLE = 15.0
#: how often (seconds) the supervisor looks for a node that exited on its own
WATCH_EVERY = 1.0


def say(t0: float, text: str) -> None:
    wall = time.strftime("%H:%M:%S", time.localtime())
    print(f"[{time.monotonic() - t0:7.1f}s {wall}] {text}", flush=True)


class Supervisor:
    """The worker nodes, each started again after it is killed (as systemd would), or
    when it exits on its own; and a liveness probe (as Kubernetes would run ``celery
    inspect ping``): a node that stops answering pings is killed -9 and started again."""

    def __init__(self, logdir: Path, env: dict[str, str], t0: float) -> None:
        self.t0 = t0
        self.nodes = {
            name: Node(name, env, logdir / f"{name}.log", concurrency=c, pool=pool, app=APP)
            for name, pool, c in NODES
        }
        self.locks = {name: threading.Lock() for name in self.nodes}
        self.hung: list[str] = []
        # epoch seconds of each kill -9 (scheduled, the probe's, after a SIGTERM ignored)
        self.kills: list[float] = []
        self.gap = env["SOAK_BROKER"].startswith("redis")
        self.broker = env["SOAK_BROKER"]
        self.probe_restarts = 0  # nodes the probe found hung, killed -9 and restarted
        self.exit_restarts = 0  # nodes that exited on their own, started again
        # nodes killed -9 for ignoring SIGTERM after Celery's unrecoverable error
        self.term_kills = 0
        self.offsets: dict[str, int] = {}  # node -> its log's size when it was started
        self.dumps = 0  # stacks of hung nodes kept (py-spy)
        self._outages = 0  # broker faults under way
        self._settled = 0.0  # monotonic time the last one ended
        self._outage_lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        for node in self.nodes.values():
            self.offsets[node.name] = node.log.stat().st_size if node.log.exists() else 0
            node.start()
        for node in self.nodes.values():
            node.wait_ready()

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """Around a fault on the broker: pings missed then, or just after, do not count."""
        with self._outage_lock:
            self._outages += 1
        try:
            yield
        finally:
            with self._outage_lock:
                self._outages -= 1
                self._settled = time.monotonic()

    def _broker_unsettled_since(self, began: float) -> bool:
        """Whether the broker was down (or settling after) at any time since ``began``."""
        with self._outage_lock:
            return self._outages > 0 or self._settled + PROBE_SETTLE > began

    def run(self, fault: Fault) -> str:
        lock = self.locks[fault.target]
        if not lock.acquire(blocking=False):
            return "skipped (node already down)"
        try:
            node = self.nodes[fault.target]
            if fault.kind == "kill9":
                # a message kombu popped from a Redis broker and the node had not yet
                # taken in is lost with it (see ``judge``)
                node.kill(signal.SIGKILL)
                self.kills.append(time.time())
            else:
                node.kill(signal.SIGTERM)
                assert node.proc is not None
                try:
                    node.proc.wait(TERM_GRACE)
                except subprocess.TimeoutExpired:
                    self._term_timeout(node, f"did not exit {TERM_GRACE:.0f}s after SIGTERM")
            node.stop()  # reaps it; SIGKILL to the group: no pool child outlives its node
            time.sleep(fault.hold)
            self.restart(node)
            return "done"
        finally:
            lock.release()

    def _term_timeout(self, node: Node, what: str) -> None:
        """A node still running ``TERM_GRACE`` s after SIGTERM is killed -9 (as systemd
        does after its stop timeout): recorded as a kill. It is hung, unless Celery's
        ``Unrecoverable error`` came first (a node it leaves up ignores SIGTERM too:
        Celery's and kombu's, docs/operations.md); then it is counted apart."""
        self.kills.append(time.time())  # node.stop() kills it -9 next
        text = node.log.read_bytes()[self.offsets.get(node.name, 0) :]
        if b"Unrecoverable error" in text:
            self.term_kills += 1
            say(
                self.t0,
                f"supervisor: {node.name} {what}, after Celery's unrecoverable error: kill -9",
            )
        else:
            self.hung.append(f"{node.name} {what}")

    def restart(self, node: Node) -> None:
        for _ in range(3):
            since = node.log.stat().st_size if node.log.exists() else 0
            self.offsets[node.name] = since
            node.start()
            try:
                node.wait_ready(since)
                return
            except RuntimeError as exc:
                say(self.t0, f"{node.name} did not come back ({str(exc)[:200]}); again")
                node.stop()
        raise RuntimeError(f"{node.name} could not be started again")

    def watch(self) -> None:
        """Start the probe (on a thread of its own) until :meth:`stop`."""
        self._watcher = threading.Thread(target=self._watch, name="probe", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        control = Celery("soak-probe", broker=self.broker)
        control.conf.broker_connection_retry_on_startup = True
        misses: dict[str, tuple[int, int]] = {}  # node -> (its pid, pings missed in a row)
        next_ping = time.monotonic() + PROBE_EVERY
        try:
            while not self._stopping.wait(WATCH_EVERY):
                for node in self.nodes.values():
                    self._exited(node)
                if time.monotonic() >= next_ping:
                    self._probe(control, misses)
                    next_ping = time.monotonic() + PROBE_EVERY
        except Exception as exc:  # the probe must not die silently
            say(self.t0, f"probe: {exc!r}; stopped")
            self.hung.append(f"the probe stopped: {exc!r}")
        finally:
            control.close()

    def _exited(self, node: Node) -> None:
        """Start ``node`` again if it exited when no fault was on it."""
        lock = self.locks[node.name]
        if not lock.acquire(blocking=False):
            return  # a fault (or the probe) has it
        try:
            if self._stopping.is_set() or node.proc is None or node.proc.poll() is None:
                return
            code = node.proc.returncode
            node.stop()  # SIGKILL to the group: no pool child outlives its node
            say(self.t0, f"supervisor: {node.name} exited on its own (code {code}); restart")
            self.exit_restarts += 1
            self._restart_or_give_up(node)
        finally:
            lock.release()

    def _probe(self, control: Celery, misses: dict[str, tuple[int, int]]) -> None:
        """Ping every node once; kill -9 and restart one that missed ``PROBE_MISSES``
        pings in a row, none of them near a broker fault."""
        began = time.monotonic()
        names = {node.hostname: node for node in self.nodes.values()}
        for attempt in range(3):  # a connection a broker fault left stale fails once
            try:
                replies = control.control.ping(destination=list(names), timeout=PROBE_TIMEOUT)
                break
            except Exception as exc:  # the broker is down: no answer means nothing
                if attempt == 2:
                    say(self.t0, f"probe: ping failed ({exc!r}); not counted")
                    return
                time.sleep(1.0)
        if self._stopping.is_set() or self._broker_unsettled_since(began):
            return  # a broker fault came near this ping: its misses do not count
        answered = {name for reply in replies for name in reply}
        for hostname, node in names.items():
            pid = node.proc.pid if node.proc is not None else 0
            if hostname in answered or self.locks[node.name].locked():
                misses.pop(node.name, None)
                continue
            was, count = misses.get(node.name, (pid, 0))
            count = count + 1 if was == pid else 1  # a node started since begins again
            misses[node.name] = (pid, count)
            say(self.t0, f"probe: {node.name} did not answer a ping ({count} in a row)")
            if count >= PROBE_MISSES:
                misses.pop(node.name, None)
                self._kill_hung(node, count)

    def _kill_hung(self, node: Node, count: int) -> None:
        lock = self.locks[node.name]
        if not lock.acquire(blocking=False):
            return
        try:
            if self._stopping.is_set():
                return
            say(self.t0, f"supervisor: {node.name} missed {count} pings: kill -9, restart")
            self._dump(node)
            node.kill(signal.SIGKILL)
            # like a scheduled kill -9: its popped, untaken message may be lost (``judge``)
            self.kills.append(time.time())
            node.stop()
            self.probe_restarts += 1
            self._restart_or_give_up(node)
        finally:
            lock.release()

    def _dump(self, node: Node) -> None:
        """Keep the hung node's threads' stacks (``py-spy dump``, when installed) beside
        its log: what it was stuck in."""
        here = str(Path(sys.executable).parent)  # a virtualenv's, not on PATH
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=here)
        if spy is None or node.proc is None:
            return
        self.dumps += 1
        out = node.log.with_name(f"{node.name}.hung{self.dumps}.txt")
        with out.open("wb") as f, contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [spy, "dump", "--nonblocking", "--pid", str(node.proc.pid)],
                stdout=f, stderr=subprocess.STDOUT, timeout=30, check=False,
            )  # fmt: skip
        say(self.t0, f"supervisor: {node.name}'s stacks in {out}")

    def _restart_or_give_up(self, node: Node) -> None:
        try:
            self.restart(node)
        except RuntimeError as exc:
            say(self.t0, f"supervisor: {exc}")
            self.hung.append(str(exc))

    def quiet(self) -> None:
        """Stop the probe (and the restarts of nodes that exit), waiting for it."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(PROBE_TIMEOUT + READY_TIMEOUT * 3)

    def stop(self, app: Celery) -> None:
        """Stop the probe; ask every node for a ping (a node that cannot answer is hung),
        then SIGTERM them all; one still running ``TERM_GRACE`` s later is hung too."""
        self.quiet()
        names = [node.hostname for node in self.nodes.values()]
        answered: set[str] = set()
        for _ in range(3):  # a connection the broker's restart left stale fails once
            try:
                replies = app.control.ping(destination=names, timeout=5.0)
            except Exception as exc:
                say(self.t0, f"ping: {exc!r}; again")
                time.sleep(1.0)
                continue
            answered |= {name for reply in replies for name in reply}
            if answered >= set(names):
                break
        self.hung += [f"{name} did not answer a ping" for name in names if name not in answered]
        for node in self.nodes.values():
            node.kill(signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE
        for node in self.nodes.values():
            if node.proc is None:
                continue
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._term_timeout(node, "did not exit after SIGTERM at the end")
            node.stop()
