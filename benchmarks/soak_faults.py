"""The soak's servers and faults: its own redis-servers (``appendonly yes``), a private
RabbitMQ node (never the machine's shared one), and a seeded schedule of faults.

A :class:`Fault` is decided in full before the soak starts (when, what, on which node
or server, for how long), so the schedule printed at the start is the one that runs;
the soak runs each fault on a thread of its own at its time, so faults overlap.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from celery_ratelimit._tools.embedded import RedisServer, free_ports

#: fault class -> its weight in the schedule's draw
NODE_FAULTS = {"kill9": 3, "term": 2}
REDIS_FAULTS = {"redis_stop": 3, "redis_restart": 2, "script_flush": 2, "client_kill": 2}
RABBIT_FAULTS = {"rabbit_restart": 2}
#: seconds a node killed stays down before the soak (its supervisor) starts it again
NODE_DOWN = (1.0, 4.0)
#: seconds a Redis stays stopped (SIGSTOP) / down for a restart; RabbitMQ down
REDIS_PAUSE = (1.0, 10.0)
REDIS_DOWN = (0.5, 3.0)
RABBIT_DOWN = (1.0, 5.0)
#: mean seconds between two moments of faults; a moment has 1 to 3 faults
MEAN_GAP = 9.0


@dataclass(frozen=True)
class Fault:
    at: float  # seconds from the start of the soak
    kind: str
    target: str  # a node's name, or a server's ("limiter", "broker", "rabbitmq")
    hold: float  # seconds paused, or down before the restart

    def __str__(self) -> str:
        return f"t={self.at:7.2f}s {self.kind:<14} {self.target:<9} hold={self.hold:5.2f}s"


def schedule(
    rng: random.Random, seconds: float, nodes: list[str], servers: list[str], rabbit: bool
) -> list[Fault]:
    """Faults over ``seconds`` (none in the first 5 s nor the last 10 s), in moments
    ``MEAN_GAP`` s apart on average, 1 to 3 faults a moment."""
    kinds = {**NODE_FAULTS, **REDIS_FAULTS, **(RABBIT_FAULTS if rabbit else {})}
    names, weights = list(kinds), list(kinds.values())
    faults = []
    at = 5.0
    while True:
        at += rng.expovariate(1 / MEAN_GAP)
        if at > seconds - 10:
            return faults
        for _ in range(rng.choices([1, 2, 3], [6, 3, 1])[0]):
            kind = rng.choices(names, weights)[0]
            if kind in NODE_FAULTS:
                target, hold = rng.choice(nodes), rng.uniform(*NODE_DOWN)
            elif kind == "rabbit_restart":
                target, hold = "rabbitmq", rng.uniform(*RABBIT_DOWN)
            else:
                target = rng.choice(servers)
                span = REDIS_PAUSE if kind == "redis_stop" else REDIS_DOWN
                hold = rng.uniform(*span) if kind in ("redis_stop", "redis_restart") else 0.0
            faults.append(Fault(round(at + rng.uniform(0, 0.5), 2), kind, target, round(hold, 2)))


@dataclass
class RedisBox:
    """One of the soak's own redis-servers, persisted (``appendonly yes``), with the
    faults that can befall it; one fault at a time on one server."""

    name: str
    server: RedisServer = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        # no AOF rewrite: the AOF keeps every write, for tracing a window afterwards
        self.server = RedisServer(
            "--appendonly", "yes", "--appendfsync", "everysec", "--auto-aof-rewrite-percentage", "0"
        )

    @property
    def url(self) -> str:
        return self.server.url

    def client(self) -> redis.Redis:
        return self.server.client(socket_timeout=5, socket_connect_timeout=5)

    def run(self, kind: str, hold: float) -> None:
        with self.lock:
            proc = self.server.proc
            if kind == "redis_stop" and proc is not None:
                proc.send_signal(signal.SIGSTOP)
                try:
                    time.sleep(hold)
                finally:
                    proc.send_signal(signal.SIGCONT)
            elif kind == "redis_restart":
                self.server.stop()  # SIGTERM: Redis writes its AOF and exits
                time.sleep(hold)
                self.server.start()  # the same port and dir: the AOF is read back
            elif kind == "script_flush":
                with self.client() as client:
                    client.script_flush()
            elif kind == "client_kill":
                with self.client() as client:
                    client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")

    def close(self, keep: Path | None = None) -> None:
        """Stop the server; ``keep``: copy its data directory (the AOF) there first."""
        with contextlib.suppress(Exception):
            if self.server.proc is not None:
                self.server.proc.send_signal(signal.SIGCONT)
        self.server.stop()
        if keep is not None:
            shutil.copytree(self.server.dir, keep / f"redis-{self.name}", dirs_exist_ok=True)
        self.server.close()


class PrivateRabbit:
    """A RabbitMQ node of the soak's own: its own node name, ports and data directory,
    started with the machine's ``rabbitmq-server`` (the shared node on 5672 is never
    touched: every command here names this node)."""

    def __init__(self) -> None:
        self.port, self.dist_port = free_ports(2)
        self.node = f"soak{os.getpid()}@localhost"
        self.dir = tempfile.mkdtemp(prefix="crl-rabbit-")
        with open(os.path.join(self.dir, "rabbitmq.conf"), "w") as conf:
            conf.write(f"listeners.tcp.local = 127.0.0.1:{self.port}\nloopback_users = none\n")
        with open(os.path.join(self.dir, "enabled_plugins"), "w") as plugins:
            plugins.write("[].\n")
        shutil.chown(self.dir, "rabbitmq", "rabbitmq")  # the server runs as rabbitmq
        for name in os.listdir(self.dir):
            shutil.chown(os.path.join(self.dir, name), "rabbitmq", "rabbitmq")
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.start()

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": os.path.join(self.dir, "mnesia"),
            "RABBITMQ_LOG_BASE": os.path.join(self.dir, "log"),
            "RABBITMQ_CONFIG_FILE": os.path.join(self.dir, "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": os.path.join(self.dir, "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": "/dev/null",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def start(self) -> None:
        with open(os.path.join(self.dir, "server.out"), "ab") as out:
            self.proc = subprocess.Popen(
                ["rabbitmq-server"], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.25)
        raise RuntimeError(f"the private RabbitMQ did not start (see {self.dir}/server.out)")

    def stop(self) -> None:
        subprocess.run(
            ["rabbitmqctl", "-n", self.node, "stop"], env=self.env, capture_output=True,
            timeout=60, check=False,
        )  # fmt: skip
        if self.proc is not None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def messages(self) -> int:
        """Messages in this node's queues, ready or unacknowledged."""
        out = subprocess.run(
            ["rabbitmqctl", "-n", self.node, "-q", "list_queues", "messages"], env=self.env,
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return sum(int(n) for n in out.stdout.split() if n.isdigit())

    def run(self, kind: str, hold: float) -> None:
        with self.lock:
            self.stop()
            time.sleep(hold)
            self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
