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
Each transition is written once, in the state it leaves. A :class:`Path` is also the
execution's check: its keys, costs and options, resolved once (its task's plan, settings
and prepared limiter call once per process: ``check._process_settings``).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from .._engine.base import ACQUIRE, CONFIRM, RESERVE, RESTAMP
from .._engine.decision import Decision, token_bytes_of
from .._engine.exceptions import InvalidLimit, LimiterMisconfigured, LimiterUnavailable
from .._engine.limit import Concurrency, describe
from .check import (
    DECISION_ATTR,
    DEFERRALS_HEADER,
    DENIALS_HEADER,
    HANDOFF_EARLY,
    HANDOFF_WAIT,
    MAX_IN_PROCESS_WAIT,
    MAX_RESTAMPS,
    PARKED_WAIT,
    RETRIES_HEADER,
    TOKEN_HEADER,
    _lease,
    _process_settings,
    _ProcessSettings,
    handed,
    hold_slots,
    on_unavailable,
    report_misconfigured,
    start_tolerance,
)
from .clock import observe
from .defer import Deferral, defer
from .green import lead
from .park import call_in_handed
from .plan import Plan
from .settings import setting

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
    # the task's plan and settings in this process, as _process_settings keeps them
    here = type(task).__dict__.get("_ratelimit_settings")
    if here is None or here.pid != os.getpid() or here.spec is not getattr(task, "ratelimit", None):
        here = _process_settings(task)
    if here.plan is not None:
        Path(task, here, tuple(args), kwargs, _token_header(task, request)).run()


class Path:
    """One execution's check (its keys, costs and options: a message header of an
    option's name overrides the task's and the app's), its walk through the states, and
    what the next state needs."""

    def __init__(
        self,
        task: Any,
        here: _ProcessSettings,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        token: str | None = None,
    ) -> None:
        self.task, self.here, self.args, self.kwargs = task, here, args, kwargs
        plan = here.plan
        assert plan is not None
        self.plan: Plan = plan
        request = self.request = task.request
        self.keys, self.costs, self.limits = plan.fixed or plan.resolve(args, kwargs)
        self.fair = plan.fair(args, kwargs) if plan.fairly else None
        self.limiter, self.green, self.metrics = here.limiter, here.green, here.metrics
        calls = vars(request)
        self.max_countdown = (
            self.setting("ratelimit_max_countdown")
            if "ratelimit_max_countdown" in calls
            else here.max_countdown
        )
        self.guard = self.setting("ratelimit_guard") if "ratelimit_guard" in calls else here.guard
        reserve = (
            self.setting("ratelimit_reserve") if "ratelimit_reserve" in calls else here.reserve
        )
        self.reserve = bool(reserve)
        self.mode = RESERVE if reserve else ACQUIRE
        self.slots, self.handy = here.slots, here.handy  # handy: may be handed a turn
        self.lease = _lease(task, request, here.concurrency_lease) if self.slots else None
        tolerance = here.tolerance
        if tolerance is None or self.guard != here.guard:
            tolerance = start_tolerance(self.limits, self.guard)
        self.tolerance = tolerance
        self.sent = 0.0  # time.monotonic() when the last decision was asked for
        self.lead = 0.0  # how long after its decision the last grant was counted
        self.restamps = 0
        self.token = token  # the reservation to confirm, or the grant to restamp
        self.restamp = False  # the next decision restamps a grant read too late
        self.waits = 0  # in-process waits so far
        self.wait_for = 0.0  # seconds the next wait expects its turn in
        self.deferral: Deferral | None = None  # what DEFER publishes

    @property
    def parking(self) -> Any:
        """The app whose park may hold copies of calls in line (None: parking is off)."""
        return self.task.app if _process_settings(self.task).park_after is not None else None

    @property
    def competing(self) -> bool:
        """The last decision was this task competing for budget (it held no slot)."""
        return self.mode in (ACQUIRE, RESERVE)

    def setting(self, name: str) -> Any:
        return setting(name, self.task.app, self.task, self.request)

    def run(self) -> None:
        handy = self.token is not None and self.handy
        state = State.WAIT if handy else State.DECIDE
        steps = {State.DECIDE: self.decide, State.WAIT: self.wait, State.DEFER: self.defer}
        while state is not State.START:
            state = steps[state]()

    def decide(self) -> State:
        restamp = self.restamp
        self.restamp = False
        try:
            decision = self.ask(self.token, restamp)
        except LimiterMisconfigured as exc:
            report_misconfigured(self, exc)
            raise
        except LimiterUnavailable as exc:
            countdown = on_unavailable(self, exc)  # raises under the policy "raise"
            if countdown is None:  # "allow"
                return State.START
            # counted like a denial: a Redis down for good must not defer it forever. A
            # reserved copy keeps its token: its slot and its place in a concurrency line
            # stay its own (a Redis that lost them makes it start as a late task does)
            slot = self.token if self.mode == CONFIRM else None
            return self.to_defer(countdown, slot, f"Redis error: {exc}", denial=True, why="redis")
        if decision.allowed:
            return self.started(decision)
        nearby = HANDOFF_WAIT if self.handy else MAX_IN_PROCESS_WAIT
        if decision.reserved and decision.retry_after <= nearby and self.waits < MAX_WAITS:
            # a turn moments away (a concurrency slot about to be free): wait for it here
            self.waits += 1
            self.token, self.wait_for = decision.token, decision.retry_after
            return State.WAIT
        why, reason = _why(decision, self.plan.limits)
        countdown = decision.retry_after
        if self.handy and decision.reserved:
            # its copy comes a little early and blocks for its turn (check.handed): the
            # slot handed over does not idle while the copy is on its way
            countdown = max(countdown - HANDOFF_EARLY, 0.0)
        slot = decision.token if decision.reserved else None
        return self.to_defer(
            min(countdown, self.max_countdown),
            slot,
            reason,
            denied_by=decision.limit,
            denial=self.competing,
            why=why,
        )

    def ask(self, token: str | None, restamp: bool = False, reserve: bool = False) -> Decision:
        """One limiter call: confirm the reservation ``token``, else acquire (reserving
        a slot when denied if ``reserve`` or ``ratelimit_reserve`` says so); or, with
        ``restamp``, start the grant ``token`` anew (see :meth:`started`)."""
        reserve = reserve or self.reserve
        self.mode = RESTAMP if restamp else CONFIRM if token else RESERVE if reserve else ACQUIRE
        self.restamps = self.restamps + 1 if restamp else 0
        self.sent = time.monotonic()
        sent = time.time()
        self.lead = lead(self.limits) if token is None and self.green else 0.0
        # the task's prepared acquisition, if the call's options are the task's
        prepared = self.here.prepared if token is None and not self.lead else None
        options = (self.max_countdown, self.guard, self.lease)
        try:
            if prepared is not None and options == self.here.options:
                decision = self.limiter._acquire_prepared(prepared, self.keys, reserve)
            else:
                decision = self.call(token, restamp, reserve)
        except (LimiterUnavailable, LimiterMisconfigured):
            if self.metrics is not None:  # a failed or timed-out decision has a latency too
                self.metrics.latency.observe(max(time.time() - sent, 0.0))
            raise
        answered = time.time()
        observe(decision, sent, answered)
        if self.metrics is not None:
            elapsed = max(answered - sent, 0.0)
            self.metrics.decision(self.plan.limits, decision, elapsed, decision.allowed, self.mode)
            self.metrics.rates(self.limiter, self.keys, self.limits)
        return decision

    def call(self, token: str | None, restamp: bool, reserve: bool) -> Decision:
        """The limiter's call for :meth:`ask`, its every argument passed."""
        limiter, keys, limits, costs = self.limiter, self.keys, self.limits, self.costs
        options: dict[str, Any] = {
            "horizon": self.max_countdown,
            "guard": self.guard,
            "hold": MAX_IN_PROCESS_WAIT,
            "lease": self.lease,
        }
        fair: dict[str, Any] = {}
        if self.fair is not None:
            fair = {"fair": self.fair[0], "fair_weight": self.fair[1]}
        if token is None:
            return limiter.acquire(
                keys, limits, costs, reserve=reserve, lead=self.lead, **options, **fair
            )
        if restamp:
            return limiter.restamp(token, keys, limits, costs, **options)
        return limiter.confirm(token, keys, limits, costs, **options, **fair)

    def started(self, decision: Decision) -> State:
        """An allowed decision: the body starts, after the in-process wait the limiter
        counted (if any); unless it would start too late for its grant: then it is
        started anew where it really starts, or, after MAX_RESTAMPS of those in a row,
        published again for a calmer moment.

        The limiter counted this call at one instant (``decision.at``); the body starts
        when this process gets to it. That is moments later, unless the reply was read
        late (a busy gevent or eventlet hub, a descheduled process) or the wait ended
        late: then bodies granted in one window could start in the next one, together
        with that window's own. Its grant is then stale, and restamped (see
        ``Limiter.restamp``, ``lua/start.lua``) at the instant it really starts. Up to half
        the guard of lateness is absorbed by the windows' slack instead, and a grant
        counted ahead of its decision (a cold start on a green pool, ``green.lead``)
        may start as much later. The bound needs no clock but this process's: Redis
        decided after ``self.sent``.
        """
        if decision.retry_after > 0:
            # Its start is moments away and already counted for that instant (the
            # limiter's hold): wait here rather than publish a copy and confirm.
            time.sleep(decision.retry_after)
        late = time.monotonic() - self.sent - decision.retry_after
        if decision.retry_after == 0:
            late -= self.lead  # a led grant is counted that much after its decision
        if late <= self.tolerance or decision.token is None:
            setattr(self.request, DECISION_ATTR, decision)
            if self.slots and decision.token is not None and self.lease is not None:
                hold_slots(self, decision.token)  # held until the body ends (see slots)
            return State.START
        if self.metrics is not None:
            self.metrics.late_start(self.plan.limits)
        if self.restamps < MAX_RESTAMPS:
            self.token, self.restamp = decision.token, True
            return State.DECIDE
        self.give_back(decision.token)  # its concurrency slots
        reason = (
            f"its grant was read {late * 1000:.0f} ms late {MAX_RESTAMPS + 1} times "
            "in a row (this worker is too busy to start it on time)"
        )
        return self.to_defer(min(late, self.max_countdown), None, reason)

    def wait(self) -> State:
        """Wait here for the turn of the reservation ``token``: sleep until it, or block
        for it (up to HANDOFF_WAIT past it) when the call may be handed its turn."""
        token = self.token
        if not self.handy:
            time.sleep(self.wait_for)
            return State.DECIDE
        # a copy in line comes from the park (called in: its turn is there already) or
        # the broker (0.1 s before its expected turn); a turn moments away is awaited here
        here = self.waits > 0
        timeout = self.wait_for + (HANDOFF_WAIT if here or self.parking is None else PARKED_WAIT)
        if token is not None and handed(self, token, timeout):
            return State.START
        return State.DECIDE

    def to_defer(self, countdown: float, token: str | None, reason: str, **how: Any) -> State:
        self.deferral = Deferral(countdown, token, reason, **how)
        return State.DEFER

    def defer(self) -> State:
        """Publish the task again (raises ``Retry``); back to DECIDE, on the token to
        confirm, when the publish failed and this process waited instead."""
        assert self.deferral is not None
        self.token = defer(self, self.deferral)
        return State.DECIDE

    def give_back(self, token: str | None) -> None:
        """Release the reservation ``token``: a slot that cannot be given back only
        wastes budget."""
        if token:
            with contextlib.suppress(LimiterUnavailable, LimiterMisconfigured):
                handed = self.limiter.release_handing(token, self.keys, self.limits, self.costs)
                call_in_handed(self.parking, self.limiter, handed)


def _why(decision: Decision, limits: tuple[Any, ...]) -> tuple[str, str]:
    """What held a call back: the event's ``why`` and the log's words."""
    limit = decision.limit
    if decision.paused:
        return "paused", "its key is paused (an operator's pause, or an upstream's 429)"
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
