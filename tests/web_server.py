"""The operator's page served by its command line (``celery-ratelimit web``) for a test."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent


class WebServer:
    """``celery-ratelimit web ARGS --port P`` (or ``celery -A APP ratelimit web`` when
    ``celery_app`` is given), started and waited for; its output kept for :meth:`log`."""

    def __init__(
        self, *args: str, celery_app: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        if celery_app is None:
            command = [sys.executable, "-m", "celery_ratelimit", "web"]
        else:
            command = [sys.executable, "-m", "celery", "-A", celery_app, "ratelimit", "web"]
        self._out = open(  # noqa: SIM115 - closed in stop()
            os.path.join(os.environ.get("TMPDIR", "/tmp"), f"crl-web-{self.port}.log"), "w+b"
        )
        self.proc = subprocess.Popen(
            [*command, *args, "--port", str(self.port)],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the page did not start: {self.log()}") from None
                time.sleep(0.1)

    def log(self) -> str:
        return Path(self._out.name).read_text("utf-8", "replace")

    def stop(self) -> None:
        """SIGTERM (uvicorn's own shutdown), SIGKILL if it is still there after 10 s."""
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._out.close()

    def __enter__(self) -> WebServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
