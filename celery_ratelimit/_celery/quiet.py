"""One INFO line per deferral: Celery's ``retry:`` line left out for the library's own.

A deferral ends the execution with a ``Retry``, which Celery's tracer logs at INFO
(``Task proj.fetch[id] retry: ...`` on the ``celery.app.trace`` logger) right after
the library's own line, which says more (the key, the countdown, the slot). The filter
below drops that one record: the deferral marks its task id and ``Retry`` in this
thread (greenlet, under gevent or eventlet) as it raises, and the next ``retry:``
record of the thread is dropped if it names both, then the mark is cleared. Any other
retry (a body's ``self.retry()``) is logged as Celery logs it. If a Celery release
drops ``LOG_RETRY``, nothing is filtered: both lines are logged, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from celery.app import trace
from celery.exceptions import Retry

_marked = threading.local()


def deferral(task_id: str | None, retry: Retry) -> Retry:
    """``retry``, marked as the deferral of ``task_id`` about to be raised."""
    _marked.value = (task_id, str(retry))
    return retry


class _DeferralRetries(logging.Filter):
    """Drops Celery's ``retry:`` record of a deferral marked in this thread."""

    def filter(self, record: logging.LogRecord) -> bool:
        marked = getattr(_marked, "value", None)
        if marked is None or record.msg != _LOG_RETRY or not isinstance(record.args, Mapping):
            return True
        _marked.value = None
        return bool((record.args.get("id"), record.args.get("exc")) != marked)


_LOG_RETRY = getattr(trace, "LOG_RETRY", None)
if _LOG_RETRY is not None:
    logging.getLogger(trace.__name__).addFilter(_DeferralRetries())
