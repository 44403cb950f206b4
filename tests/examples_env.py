"""Private Redis servers and worker nodes for running the examples and the CLI as a
user would: ``celery -A examples.X worker`` subprocesses, ``python -m examples.X``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from celery import Celery

from celery_ratelimit._tools.embedded import WorkerNodes
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent


def env_for(broker: RedisServer, limiter: RedisServer, **extra: str) -> dict[str, str]:
    """The environment the examples read, pointing at the private servers."""
    return {
        "CELERY_BROKER_URL": broker.url.replace("/0", "/1"),
        "RATELIMIT_REDIS_URL": limiter.url,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    }


@contextmanager
def workers(app_module: str, env: dict[str, str], count: int = 2) -> Iterator[WorkerNodes]:
    """``count`` prefork nodes of ``app_module``, stopped (process groups) on the way out;
    their logs are printed when the block fails."""
    nodes = WorkerNodes(app_module, count, env, concurrency=2)
    ping_app = Celery("ping", broker=env["CELERY_BROKER_URL"])
    try:
        nodes.start(ping_app)
        yield nodes
    except BaseException:
        for log in sorted(Path(nodes.logdir).glob("*.log")):
            sys.stderr.write(f"--- {log}\n{log.read_text()[-4000:]}\n")
        raise
    finally:
        nodes.stop()
        ping_app.close()


def run(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run a command from the repository root with ``env`` added; output captured."""
    return subprocess.run(
        args,
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
