"""A task's path before its body: one explicit state machine.

::

    (token of a handed turn?) ──> WAIT ──> START
                                   │ ▲
                                   ▼ │
    ─────────────────────────────> DECIDE ──> START    allowed, on time
                                   │  ▲ ├──> DECIDE   allowed, read too late: restamp
                                   │  │ └──> FAIL     Redis refuses the limiter
                                   ▼  │
                                  DEFER               published again: Retry ends it

``DECIDE`` asks the limiter once (acquire, confirm the message's reservation, or
restamp a grant read late); ``WAIT`` waits in this process for a turn moments away (a
sleep, or blocking for a concurrency slot handed over); ``DEFER`` publishes the task
again (``defer``) and ends this execution with ``Retry``, or, when the publish failed
and this process waited instead, goes back to ``DECIDE``; ``START`` lets the body run.
Each transition is written once, in the state it leaves.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping
from typing import Any

from .._engine.decision import Decision, token_bytes_of
from .._engine.exceptions import InvalidLimit, LimiterMisconfigured, LimiterUnavailable
from .._engine.limit import Concurrency, describe
from .check import (
    DEFERRALS_HEADER,
    DENIALS_HEADER,
    HANDOFF_EARLY,
    HANDOFF_WAIT,
    MAX_IN_PROCESS_WAIT,
    MAX_RESTAMPS,
    PARKED_WAIT,
    RETRIES_HEADER,
    TOKEN_HEADER,
    Check,
)
from .defer import Deferral, defer
from .plan import plan_for

logger = logging.getLogger("celery_ratelimit")

#: A task waits in-process at most this many times in a row for a turn moments away
#: (each at most MAX_IN_PROCESS_WAIT), then is published again.
MAX_WAITS = 5


class State(enum.Enum):
    DECIDE = "decide"
    WAIT = "wait here"
    DEFER = "defer"
    START = "start"


def enforce(task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Return if the task may run now; else publish it again for later and raise
    ``Retry`` (which ends this execution in state ``RETRY``).

    Raises:
        Retry: the task was deferred.
        RateLimitExceeded: deferred for want of budget (denied while holding no slot,
            or Redis unreachable) more than ``ratelimit_max_deferrals`` times.
        InvalidLimit: the call's key or cost cannot be worked out (the task fails).
        LimiterUnavailable: Redis is down and the policy is ``"raise"``.
        LimiterMisconfigured: Redis refuses the limiter (logged once per interval).
    """
    request = task.request
    if request.is_eager or request.called_directly:
        return
    plan = plan_for(task)
    if plan is not None:
        Path(Check(task, plan, tuple(args), kwargs), _token_header(task, request)).run()


class Path:
    """One execution's walk through the states, and what the next state needs."""

    def __init__(self, check: Check, token: str | None) -> None:
        self.check = check
        self.token = token  # the reservation to confirm, or the grant to restamp
        self.restamp = False  # the next decision restamps a grant read too late
        self.waits = 0  # in-process waits so far
        self.wait_for = 0.0  # seconds the next wait expects its turn in
        self.deferral: Deferral | None = None  # what DEFER publishes

    def run(self) -> None:
        handy = self.token is not None and self.check.handy
        state = State.WAIT if handy else State.DECIDE
        steps = {State.DECIDE: self.decide, State.WAIT: self.wait, State.DEFER: self.defer}
        while state is not State.START:
            state = steps[state]()

    def decide(self) -> State:
        check, restamp = self.check, self.restamp
        self.restamp = False
        try:
            decision = check.decide(self.token, restamp)
        except LimiterMisconfigured as exc:
            check.report_misconfigured(exc)
            raise
        except LimiterUnavailable as exc:
            countdown = check.on_unavailable(exc)  # raises under the policy "raise"
            if countdown is None:  # "allow"
                return State.START
            # counted like a denial: a Redis down for good must not defer it forever
            return self.to_defer(countdown, None, f"Redis error: {exc}", denial=True, why="redis")
        if decision.allowed:
            return self.started(decision)
        nearby = HANDOFF_WAIT if check.handy else MAX_IN_PROCESS_WAIT
        if decision.reserved and decision.retry_after <= nearby and self.waits < MAX_WAITS:
            # a turn moments away (a concurrency slot about to be free): wait for it here
            self.waits += 1
            self.token, self.wait_for = decision.token, decision.retry_after
            return State.WAIT
        why, reason = _why(decision, check.plan.limits)
        countdown = decision.retry_after
        if check.handy and decision.reserved:
            # its copy comes a little early and blocks for its turn (Check.handed): the
            # slot handed over does not idle while the copy is on its way
            countdown = max(countdown - HANDOFF_EARLY, 0.0)
        slot = decision.token if decision.reserved else None
        return self.to_defer(
            min(countdown, check.max_countdown),
            slot,
            reason,
            denied_by=decision.limit,
            denial=check.competing,
            why=why,
        )

    def started(self, decision: Decision) -> State:
        """An allowed decision: start, unless its reply was read too late to start on;
        then start it anew where it really starts, or, after MAX_RESTAMPS of those in a
        row, publish it again for a calmer moment."""
        check = self.check
        late = check.start(decision)
        if not late:
            return State.START
        if check.restamps < MAX_RESTAMPS:
            self.token, self.restamp = decision.token, True
            return State.DECIDE
        check.give_back(decision.token)  # its concurrency slots
        reason = (
            f"its grant was read {late * 1000:.0f} ms late {MAX_RESTAMPS + 1} times "
            "in a row (this worker is too busy to start it on time)"
        )
        return self.to_defer(min(late, check.max_countdown), None, reason)

    def wait(self) -> State:
        """Wait here for the turn of the reservation ``token``: sleep until it, or block
        for it (up to HANDOFF_WAIT past it) when the call may be handed its turn."""
        check, token = self.check, self.token
        if not check.handy:
            time.sleep(self.wait_for)
            return State.DECIDE
        # a copy in line comes from the park (called in: its turn is there already) or
        # the broker (0.1 s before its expected turn); a turn moments away is awaited here
        here = self.waits > 0
        timeout = self.wait_for + (HANDOFF_WAIT if here or check.parking is None else PARKED_WAIT)
        if token is not None and check.handed(token, timeout):
            return State.START
        return State.DECIDE

    def to_defer(self, countdown: float, token: str | None, reason: str, **how: Any) -> State:
        self.deferral = Deferral(countdown, token, reason, **how)
        return State.DEFER

    def defer(self) -> State:
        """Publish the task again (raises ``Retry``); back to DECIDE, on the token to
        confirm, when the publish failed and this process waited instead."""
        assert self.deferral is not None
        self.token = defer(self.check, self.deferral)
        return State.DECIDE


def _why(decision: Decision, limits: tuple[Any, ...]) -> tuple[str, str]:
    """What held a call back: the event's ``why`` and the log's words."""
    limit = decision.limit
    if decision.paused:
        return "paused", "its key is paused (an upstream answered 429)"
    if isinstance(limit, Concurrency):
        return "concurrency", f"waiting for a slot of {limit.label}"
    return "limit", f"rate limited by {limit.label if limit else describe(limits)}"


def _token_header(task: Any, request: Any) -> str | None:
    """The message's reservation token; one the limiter did not write is no token (the
    task competes afresh), and a user's ``self.retry()`` of a deferred task starts
    afresh too: its copy carries the headers of the execution it retries."""
    if getattr(request, RETRIES_HEADER, request.retries) != request.retries:
        setattr(request, DEFERRALS_HEADER, 0)
        setattr(request, DENIALS_HEADER, 0)
        setattr(request, TOKEN_HEADER, None)
    token = getattr(request, TOKEN_HEADER, None) or None
    if token is None:
        return None
    try:
        token_bytes_of(token)
    except InvalidLimit as exc:
        logger.warning("ratelimit: %s[%s]: %s; competing without it", task.name, request.id, exc)
        return None
    return str(token)
