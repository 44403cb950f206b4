"""Deferrals give way to running bodies on the green pools (gevent, eventlet).

On a green pool one hub runs every task of the process in turn. In a flood (a cold
node taking fifty tasks at once, most of them denied) the denied tasks' deferral work
(building the copy, publishing it, Celery's handling of the ``Retry``) would run
between a granted body's first line and its first request: each time the body waits
for a socket, the hub runs a turn of every denied task first, and the upstream sees
the request that much later than the limiter counted the start. A denied task has a
wait ahead of it anyway, so before publishing it waits until the hub has nothing else
to do, one denied task at a time (all at once, they would run together the moment the
hub idles): the bodies' I/O goes first.

A cold start is counted where its first request will be (:func:`lead`). When a node
takes a flood after a quiet spell, its first bodies open their connections (a name
lookup, a connect, a handshake: each a turn of a hub busy with the flood's messages)
and their first requests reach their servers 100-200 ms after their first lines,
while the next window's bodies, warm, send theirs at once. Their grants are counted
that much later, so the next window's slots come after those requests.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from .._engine.limit import Limit

#: Longest a deferral waits for its turn at an idle hub (seconds), and at most half
#: its countdown: a hub that never idles (every greenlet busy) delays the deferral's
#: publish by this much at most.
MAX_GIVE_WAY = 1.0
#: A hub turn shorter than this (seconds) ran nothing else: the hub is idle.
QUIET_TURN = 0.0005

#: On a green pool, the grants of a process's first window of decisions after a quiet
#: spell are counted this long after they are made (seconds): about the most a cold
#: body's first request was measured behind its first line (docs/benchmarks.md, 9b).
COLD_LEAD = 0.2

_turn: Any = None  # the green lock denied tasks take turns with, made on first use
#: time.monotonic() of this process's first decision after a quiet spell, and its last
_cold_since = _last_decision = float("-inf")


def _pool() -> str:
    """``"gevent"``, ``"eventlet"`` (this process's sockets are theirs), or ``""``."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("socket"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("socket"):
        return "eventlet"
    return ""


def give_way(countdown: float) -> float:
    """Wait until the green hub of this process has nothing else to run, taking turns
    with the other callers (at most half ``countdown``, at most ``MAX_GIVE_WAY``);
    returns the seconds waited (0.0 at once off the green pools)."""
    global _turn
    pool = _pool()
    most = min(countdown / 2, MAX_GIVE_WAY)
    if not pool or most <= 0:
        return 0.0
    begun = time.monotonic()
    if pool == "gevent":
        from gevent import sleep
        from gevent.lock import Semaphore
    else:
        from eventlet import sleep
        from eventlet.semaphore import Semaphore
    if _turn is None:
        _turn = Semaphore()
    if not _turn.acquire(timeout=most):
        return time.monotonic() - begun
    try:
        # a sleep(0) resumes after the hub's next poll: every greenlet whose socket
        # is ready has run by then; the hub is idle once a turn ran nothing else
        while time.monotonic() - begun < most:
            turn = time.monotonic()
            sleep(0)
            if time.monotonic() - turn < QUIET_TURN:
                break
    finally:
        _turn.release()
    return time.monotonic() - begun


def lead(limits: tuple[Any, ...]) -> float:
    """How long after now (seconds) a grant of ``limits`` made now is counted:
    :data:`COLD_LEAD` on a green pool during this process's first window of decisions
    after a quiet spell (see :func:`cold_lead`), else 0.0. Noted as a decision made now.

    A grant counted later than its start never lets a window hold more starts than the
    limit (every later decision counts its entry); it moves the next window's slots
    that much later, once per cold spell."""
    global _cold_since, _last_decision
    if not _pool():
        return 0.0
    window = min(
        (one.fixed_rate.window for one in limits if isinstance(one, Limit) and one.align is None),
        default=0.0,
    )
    now = time.monotonic()
    ahead, _cold_since = cold_lead(now, window, _last_decision, _cold_since)
    _last_decision = now
    return ahead


def cold_lead(now: float, window: float, last: float, since: float) -> tuple[float, float]:
    """(the lead of a decision made at ``now``, when the cold spell it belongs to began):
    a decision more than ``window`` after the ``last`` one begins a cold spell; every
    decision within ``window`` of its spell's beginning (``since``) is led by
    :data:`COLD_LEAD`. A call with no sliding window (``window`` 0) is never led."""
    if now - last > window:
        since = now
    return (COLD_LEAD if now - since < window else 0.0), since
