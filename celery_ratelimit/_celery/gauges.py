"""Gauges of what the library keeps in Redis: copies waiting in the park, keys paused,
keys with a rate override. Each worker node with ``ratelimit_metrics`` on reads them
every :data:`EVERY` seconds in a thread of its main process (three cheap commands: the
park's sorted set, and the indexes ``Limiter.pause`` and ``Limiter.override`` keep, so
that 100,000 keys cost no scan). They are counts, with no label.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery import signals

from .._engine.layout import OVERRIDES_INDEX, PAUSED_INDEX
from .metrics import metrics_for
from .park import limited, park_keys
from .settings import limiter_for

logger = logging.getLogger("celery_ratelimit")

#: Seconds between two reads.
EVERY = 5.0


def read_gauges(app: Any) -> dict[str, int] | None:
    """Read the three counts from ``app``'s limiter Redis and set the gauges (None:
    metrics are off).

    Raises:
        redis.RedisError: Redis failed.
    """
    metrics = metrics_for(app)
    if metrics is None:
        return None
    limiter = limiter_for(app)
    counts = {
        "parked": int(limiter.client.zcard(park_keys(app, limiter)[0])),
        "paused_keys": limiter._indexed(PAUSED_INDEX),
        "overrides": limiter._indexed(OVERRIDES_INDEX),
    }
    for name, value in counts.items():
        getattr(metrics, name).set(value)
    return counts


class _Reader(threading.Thread):
    def __init__(self, app: Any) -> None:
        super().__init__(name="celery-ratelimit-gauges", daemon=True)
        self.app = app
        self.stopping = threading.Event()

    def run(self) -> None:
        while True:
            try:
                read_gauges(self.app)
            except Exception as exc:  # Redis away: the decisions say so
                logger.debug("ratelimit: could not read the gauges: %s", exc)
            if self.stopping.wait(EVERY):
                return


_readers: dict[int, _Reader] = {}


def _start(sender: Any = None, **_: Any) -> None:
    """``worker_ready``: start the node's reader if it records metrics."""
    app = getattr(sender, "app", None)
    if app is None or os.getpid() in _readers or not limited(app) or metrics_for(app) is None:
        return
    reader = _readers[os.getpid()] = _Reader(app)
    reader.start()


def _stop(**_: Any) -> None:
    reader = _readers.pop(os.getpid(), None)
    if reader is not None:
        reader.stopping.set()


signals.worker_ready.connect(_start, weak=False)
signals.worker_shutdown.connect(_stop, weak=False)

__all__ = ["EVERY", "read_gauges"]
