"""pytest plugin for Celery's own integration suite: every task passes the limiter.

Loaded by ``tests/celery_canvas.py`` (``-p tests.celery_canvas_plugin``) into a run of
``t/integration/`` from Celery's source distribution. With ``CRL_CANVAS_RATE`` set, it
gives the suite's session app (the one its in-process worker runs) the rule
``{"t.integration.tasks.*": <rate>}`` and calls ``install()`` before the worker starts,
so every task of the suite is checked, and deferred when the rate is spent. Each
deferral is counted in the file ``CRL_CANVAS_DEFERRALS`` (one byte per deferral, from
every pool process) so the run can say how many happened. Plain or limited, the run's
outcome (how many passed, failed, xfailed, xpassed; which failed) is written as JSON to
``CRL_CANVAS_REPORT``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

from celery_ratelimit import install

RATE_ENV = "CRL_CANVAS_RATE"
COUNT_ENV = "CRL_CANVAS_DEFERRALS"
REPORT_ENV = "CRL_CANVAS_REPORT"
#: Every task module of the suite (``t/integration/tasks.py``).
PATTERN = "t.integration.tasks.*"


class _DeferralCounter(logging.Handler):
    """Appends one byte to a file per "deferred" line the limiter logs (appends of one
    byte from several processes do not interleave)."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("ratelimit: deferred "):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, b".")
            finally:
                os.close(fd)


@pytest.fixture(scope="session", autouse=True)
def ratelimit_every_task(celery_session_app: Any) -> Iterator[None]:
    rate = os.environ.get(RATE_ENV)
    if rate:
        celery_session_app.conf.ratelimit_rules = {PATTERN: rate}
        install(celery_session_app)
        limiter_log = logging.getLogger("celery_ratelimit")
        limiter_log.setLevel(logging.INFO)  # the deferral lines are INFO
        limiter_log.addHandler(_DeferralCounter(os.environ[COUNT_ENV]))
    yield


def pytest_terminal_summary(terminalreporter: Any) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    stats = terminalreporter.stats
    outcome = {  # counted as pytest's closing line counts them
        name: sum(1 for r in stats.get(name, ()) if getattr(r, "count_towards_summary", True))
        for name in ("passed", "failed", "error", "xfailed", "xpassed", "skipped", "rerun")
    }
    failed = sorted({r.nodeid for name in ("failed", "error") for r in stats.get(name, ())})
    with open(path, "w") as file:
        json.dump({"outcome": outcome, "failed": failed}, file, indent=1)
