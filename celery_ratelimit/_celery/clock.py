"""Deferral ETAs in Redis time, so that worker clocks that disagree cannot strand a task.

Celery turns a countdown into an absolute ``eta`` with the *sending* worker's clock,
and the receiving worker waits until its *own* clock reaches it. Measured with three
nodes (one on time, one an hour ahead, one an hour behind, under ``faketime``): half of
a 40-task backlog deferred for under four seconds was held for an hour or two by the
nodes whose clocks disagreed with the sender's. The limiter decides by Redis's clock
(``TIME``), so that clock is the common frame for the ETAs of deferred tasks:

- the deferring worker publishes ``eta`` = Redis's now + countdown, knowing Redis's
  now from its decisions (:func:`observe`: ``Decision.at`` against the local times the
  call was sent and answered; the sample with the shortest round trip of the last
  :data:`OFFSET_TTL` seconds is kept unless a later one rules it out: on a loaded
  machine a process descheduled before it reads a reply sees that reply 100 ms late
  or more, and an offset taken from it alone made copies arrive that much early);
- the receiving worker, in the ``task_received`` signal (sent before Celery schedules
  the ETA), moves the ``eta`` of a deferred task (one with a ``ratelimit_deferrals``
  header) from Redis time to its own clock, with its offset to Redis measured by one
  ``TIME`` call at most every :data:`OFFSET_TTL` seconds (failures are cached too, so a
  down Redis never slows the consumer down more than once per interval).

With clocks in step both corrections are a millisecond or so. Before the first decision
the offset is taken as 0 (the plain countdown). Early arrivals that remain (a clock
stepped since its last measurement) are still caught by the confirmation of the reserved
slot: a task never runs before its slot.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

from celery import signals

from .._engine.decision import Decision
from .compat import set_received_eta
from .settings import limiter_for

logger = logging.getLogger("celery_ratelimit")

#: Seconds a measured offset to Redis is trusted before it is measured again.
OFFSET_TTL = 60.0
#: A receiving worker whose best of three TIME samples took longer than this (seconds:
#: the offset is uncertain by half of it) measures again after a second, not a minute.
TRUSTED_ROUND_TRIP = 0.02
#: Redis time minus local time, seconds, and when it was measured (time.monotonic()).
_offset: float | None = None
_measured_at = -OFFSET_TTL
#: The deferring side's best sample: its round trip (seconds) and when it was taken.
_observed_rtt = float("inf")
_observed_at = -OFFSET_TTL


def observe(decision: Decision, sent: float, answered: float) -> None:
    """Note this process's clock offset to Redis from a decision: ``sent`` and
    ``answered`` are the local ``time.time()`` just before the call and just after.

    The script read Redis's clock somewhere in between, so the offset lies between
    ``at - answered`` and ``at - sent``. The sample replaces the one in use if its round
    trip is no longer, if that one is older than :data:`OFFSET_TTL`, or if that one
    falls outside this sample's bounds (a clock was stepped since).
    """
    global _offset, _observed_rtt, _observed_at
    # a reservation or a held start is answered with its instant and the time to it
    ahead = decision.reserved or decision.allowed
    redis_now = decision.at - (decision.retry_after if ahead else 0.0)
    rtt = answered - sent
    now = time.monotonic()
    if (
        rtt > _observed_rtt
        and now - _observed_at < OFFSET_TTL
        and _offset is not None
        and redis_now - answered <= _offset <= redis_now - sent
    ):
        return  # a looser sample that agrees with the one in use
    _offset = redis_now - (sent + answered) / 2
    _observed_rtt, _observed_at = rtt, now


def redis_eta(countdown: float) -> datetime.datetime:
    """The instant ``countdown`` seconds from now, in Redis time (UTC), for ``eta=``."""
    return datetime.datetime.fromtimestamp(
        time.time() + (_offset or 0.0) + countdown, tz=datetime.timezone.utc
    )


def _measured_offset(app: Any) -> float | None:
    global _offset, _measured_at
    if time.monotonic() - _measured_at < OFFSET_TTL:
        return _offset
    _measured_at = time.monotonic()
    try:
        client = limiter_for(app).client
        client.ping()  # connect first: a connection set up inside the sample skews it
        samples = []
        for _ in range(3):
            before = time.time()
            seconds, micros = client.time()
            after = time.time()
            samples.append((after - before, seconds + micros / 1_000_000 - (before + after) / 2))
    except Exception as exc:  # keep the last offset; try again after OFFSET_TTL
        logger.debug("ratelimit: could not read Redis TIME: %s", exc)
        return _offset
    rtt, _offset = min(samples)  # the sample with the shortest round trip
    if rtt > TRUSTED_ROUND_TRIP:
        _measured_at -= OFFSET_TTL - 1.0  # a busy moment: measure again in a second
    return _offset


def _eta_to_local_clock(request: Any = None, **_: Any) -> None:
    """``task_received``: move a deferred task's ``eta`` from Redis time to this clock."""
    try:
        headers = request.request_dict or {}
        eta = request.eta
        if eta is None or not headers.get("ratelimit_deferrals"):
            return
        offset = _measured_offset(request.task.app)
        if offset:
            set_received_eta(request, eta - datetime.timedelta(seconds=offset))
    except Exception as exc:  # never break message handling; the plain ETA still works
        logger.debug("ratelimit: could not adjust the ETA of %s: %s", request, exc)


signals.task_received.connect(_eta_to_local_clock, weak=False)
