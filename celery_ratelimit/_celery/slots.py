"""The concurrency slots held by this process's running task bodies.

A body's slot (see ``Concurrency`` and ``lua/lib/concurrency.lua``) is taken by the decision that
lets it run. While the body runs, a thread of this process renews its lease every third
of it; when the body ends, on every exit the tracer reports (success, an exception,
``Retry``, ``Reject``, ``Ignore``, a soft time limit), the ``task_postrun`` handler
releases it. A release Redis did not take (a connection reset, Redis paused or
restarting) is tried again by that thread, every tick until its lease would have run out
(after which the slot has come back by itself): a slot freed during a blip of Redis
idles for the blip, not for its lease (300 s by default). A body started on a turn
handed over to it (``check.handed``) holds its slot on a short lease at first: its first
renewal comes before that lease runs out (``due``). A body that cannot end normally (its
process killed by a hard time limit, ``revoke(terminate=True)``, a lost node) stops being
renewed: its slot comes back when its lease runs out.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from celery import signals

from .._engine.limiter import Limiter
from .park import call_in_handed

logger = logging.getLogger("celery_ratelimit")

#: Request attribute holding the running body's slot (not a ``ratelimit_`` header),
#: kept beside the request like the Decision (see ``task.Beside``).
SLOT_ATTR = "_ratelimit_slot"


@dataclass
class Held:
    """One body's slots: released by :func:`release`, renewed until then."""

    limiter: Limiter
    keys: tuple[str, ...]  # escaped, one per concurrency limit
    limits: tuple[Any, ...]  # the call's Concurrency limits
    token: str  # the call's token without its costs (these limits count none)
    lease: float
    renewed: float = field(default_factory=time.monotonic)
    #: time.monotonic() by which the first renewal is due (a handed turn's short lease)
    due: float | None = None
    #: the Celery app whose park may hold copies of waiting calls to call in (see
    #: ``park.call_in``); None when nothing is parked
    app: Any = None

    def renew(self) -> None:
        if not self.limiter.renew(self.token, self.keys, self.limits, lease=self.lease):
            logger.warning(
                "ratelimit: the concurrency slot of a running body was lost (its lease of "
                "%gs ran out before it was renewed: was this process stalled?); another "
                "body may have taken it",
                self.lease,
            )
        self.renewed = time.monotonic()
        self.due = None

    def renew_now(self, at: float) -> bool:
        """True if the lease should be renewed at ``at`` (time.monotonic())."""
        return at - self.renewed >= self.lease / 3 or (self.due is not None and at >= self.due)


_held: dict[str, Held] = {}
#: Slots whose release failed, to be tried again by the renewer thread.
_unreleased: list[Held] = []
_lock = threading.Lock()
_renewer_pid: int | None = None
#: Wakes the renewer for a slot whose first renewal is due sooner than its next tick.
_wake = threading.Event()


def hold(request: Any, held: Held) -> None:
    """Note that the body of ``request`` holds ``held`` until it ends."""
    setattr(request, SLOT_ATTR, held)
    with _lock:
        _held[held.token] = held
    _start_renewer()
    if held.due is not None:
        _wake.set()


def release(request: Any) -> None:
    """Give back the slot the body of ``request`` holds, if any (at most once); one Redis
    did not take is tried again by the renewer thread."""
    held = getattr(request, SLOT_ATTR, None)
    if held is None:
        return
    setattr(request, SLOT_ATTR, None)
    with _lock:
        _held.pop(held.token, None)
    try:
        _give_back(held)
    except Exception as exc:
        logger.warning(
            "ratelimit: could not release a concurrency slot (%s); trying again until "
            "Redis answers (at the latest, it comes back when its lease of %gs runs out)",
            exc,
            held.lease,
        )
        with _lock:
            _unreleased.append(held)
        _start_renewer()
        _wake.set()


def _give_back(held: Held) -> None:
    handed = held.limiter.release_handing(held.token, held.keys, held.limits)
    call_in_handed(held.app, held.limiter, handed)


def _release_again(now: float) -> None:
    """Try again the releases that failed, until one fails again (Redis is still away:
    the next tick tries again, and the renewals of running bodies are not held up by a
    timeout per release); drop those whose lease has run out by now (their slots came
    back: the next decision sweeps them)."""
    with _lock:
        pending = list(_unreleased)
    for held in pending:
        if now < held.renewed + held.lease:
            try:
                _give_back(held)
            except Exception as exc:
                logger.debug("ratelimit: could not release a concurrency slot: %s", exc)
                return
        else:
            logger.info(
                "ratelimit: a concurrency slot's lease ran out before Redis took its "
                "release; the slot is free again"
            )
        with _lock:
            _unreleased.remove(held)


def _start_renewer() -> None:
    global _renewer_pid
    with _lock:
        if _renewer_pid == os.getpid():
            return
        _renewer_pid = os.getpid()  # a forked pool process starts its own
    threading.Thread(target=_renew_forever, name="ratelimit-lease", daemon=True).start()


def _renew_forever() -> None:
    while True:
        with _lock:
            held = list(_held.values())
        now = time.monotonic()
        tick = min(
            [1.0, *(one.lease / 4 for one in held), *(one.due - now for one in held if one.due)]
        )
        _wake.wait(max(tick, 0.05))
        _wake.clear()
        now = time.monotonic()
        if _unreleased:
            _release_again(now)
        for one in held:
            if one.renew_now(now) and one.token in _held:
                try:
                    one.renew()
                except Exception as exc:  # Redis away: the next tick tries again
                    logger.debug("ratelimit: could not renew a concurrency slot: %s", exc)


def _release_after_body(task: Any = None, **_: Any) -> None:
    if task is not None:
        release(task.request)


signals.task_postrun.connect(_release_after_body, weak=False)
