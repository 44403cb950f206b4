"""A real prefork worker node of ``tests.apps.metrics_node`` serving its metrics by the
recipe of docs/operations.md (the metrics and dashboard tests start it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class MetricsNode:
    prefix: str  # its key prefix; its tasks' runs are in "<prefix>:runs" on the broker
    port: int  # its metrics: http://127.0.0.1:<port>/metrics
    log: Path


@contextlib.contextmanager
def metrics_node(
    broker: str, limiter: str, scratch: Path, pool: str = "prefork", concurrency: int = 2
) -> Iterator[MetricsNode]:
    """Start the node (two pool processes, or ``pool`` with ``concurrency``) on ``broker``
    with the limiter's Redis at ``limiter``; wait until it is ready; stop it on leaving."""
    node = MetricsNode(f"crl-metrics-{uuid.uuid4().hex[:8]}", free_port(), scratch / "node.log")
    multiproc = scratch / "prom"
    multiproc.mkdir()
    env = {
        **os.environ,
        "CRL_BROKER": broker,
        "CRL_REDIS": limiter,
        "CRL_PREFIX": node.prefix,
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "METRICS_PORT": str(node.port),
    }
    with node.log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "tests.apps.metrics_node", "worker",
                "-P", pool, "-c", str(concurrency), "--without-gossip", "--without-mingle",
                "--without-heartbeat", "-l", "INFO",
            ],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "ready." not in node.log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, node.log.read_text()
            time.sleep(0.2)
        yield node
    finally:
        proc.terminate()
        proc.wait(30)
