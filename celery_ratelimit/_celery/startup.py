"""The limiter's Redis, tried once when a worker node is ready.

A connection refused on a worker's first call is almost always a configuration error
(a typo in ``ratelimit_redis_url``, a Redis that is not started), yet to a task it looks
like any outage: under the default policy the task is deferred again every second,
with one WARNING per interval. So each node that runs rate-limited tasks checks its
limiter once at ``worker_ready`` (in a thread: a host that drops packets costs the
connect timeout) and logs an ERROR that names the setting and the URL (its password
hidden) if nothing answered there. An outage after the limiter has answered is left to
the tasks' ``ratelimit_on_redis_error`` policy, as before.

A rule of ``ratelimit_rules`` that limits no task (a typo in a task's name, or
``install(app)`` never called) would leave that task unlimited without a word: the node
logs one WARNING for it at the same moment.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals

from .._engine.client import redacted
from .._engine.exceptions import LimiterMisconfigured, LimiterUnavailable
from .._engine.failures import never_reached
from . import gauges  # noqa: F401  (its reader starts at worker_ready)
from .install import rule_warnings
from .park import limited
from .settings import limiter_for, redis_url, redis_url_source, setting

logger = logging.getLogger("celery_ratelimit")


def check_at_start(app: Any) -> None:
    """Try the limiter of ``app`` once; log an ERROR naming ``ratelimit_redis_url`` if
    no server answered at its URL. Other failures are left for the first task to report
    (a refused password, a server too old: ``LimiterMisconfigured`` names the fix)."""
    try:
        limiter_for(app).check()
    except LimiterUnavailable as exc:
        if never_reached(exc):
            logger.error("ratelimit: %s", unreachable_message(app, exc))
    except LimiterMisconfigured:
        pass


def unreachable_message(app: Any, exc: LimiterUnavailable) -> str:
    """What to tell about a limiter URL where no server answered."""
    url, source = redis_url(app), redis_url_source(app)
    policy = setting("ratelimit_on_redis_error", app)
    return (
        f"nothing answered at the limiter's Redis URL {redacted(url)} ({source}) "
        f"when this worker started ({exc.__cause__}): check that ratelimit_redis_url names "
        "the Redis that keeps the budgets (host, port), that it runs, and that this host "
        f"can reach it. Until it answers, rate-limited tasks follow "
        f"ratelimit_on_redis_error={policy!r}"
    )


def _check_when_ready(sender: Any = None, **_: Any) -> None:
    """``worker_ready``: say which rules limit nothing; check the limiter, if the node
    runs rate-limited tasks."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    for warning in rule_warnings(app):
        logger.warning("ratelimit: %s", warning)
    if not limited(app):
        return
    threading.Thread(
        target=check_at_start, args=(app,), name="ratelimit-start-check", daemon=True
    ).start()


signals.worker_ready.connect(_check_when_ready, weak=False)
