"""One execution's check: its keys, costs and options, resolved once, and the steps the
path (``path``) takes: the limiter call, the start (after an in-process wait the limiter
counted), a handed turn, and the handling of a Redis failure under the task's policy.
The deferral is ``defer``'s; the message headers it writes are named here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery.app.task import Context

from .._engine.base import ACQUIRE, CONFIRM, RESERVE, RESTAMP
from .._engine.decision import Decision
from .._engine.exceptions import LimiterMisconfigured, LimiterUnavailable
from .._engine.limit import Concurrency, Limit
from .._engine.limiter import Limiter
from . import clock
from .beside import attach
from .clock import observe
from .green import _pool, lead
from .metrics import metrics_for
from .park import call_in_handed
from .plan import Plan
from .settings import limiter_for, park_after, setting
from .slots import Held, hold, release

logger = logging.getLogger("celery_ratelimit")

#: What the names of the message headers we write begin with.
OUR_HEADERS = "ratelimit_"
#: Message headers written on a deferral.
DEFERRALS_HEADER = "ratelimit_deferrals"
#: How many of those deferrals the task could not get budget: the limit denied it
#: while it held no slot, or Redis was unreachable (``ratelimit_max_deferrals`` counts
#: these). A reserved slot moved later and a worker too busy to start the task on
#: time are the library's doing, not the budget's, and do not count.
DENIALS_HEADER = "ratelimit_denials"
TOKEN_HEADER = "ratelimit_token"
#: ``request.retries`` of the execution that was deferred (see ``path._token_header``).
RETRIES_HEADER = "ratelimit_retries"
#: Request attribute holding the Decision that let the task run: kept beside the
#: request, not in it, since a copy of the request's attributes may become a message.
DECISION_ATTR = "ratelimit_decision"
attach(DECISION_ATTR)
#: A body never deferred reads ``request.ratelimit_deferrals`` as 0, whatever context
#: Celery built for it (an eager call's, a fresh one of ``Task.__call__``): a default on
#: ``Context`` itself; a deferred copy's header sets the request's own value. (Celery
#: then leaves the name out of the headers its ``self.retry()`` publishes: a retry
#: counts its deferrals anew, as ``path._token_header`` does.)
if not hasattr(Context, DEFERRALS_HEADER):
    setattr(Context, DEFERRALS_HEADER, 0)
#: A start at most this far ahead (an early arrival, a reservation this close, a
#: late task waiting for the window) is waited for in-process instead of being
#: published again; the limiter counts it for that instant, so no second call follows.
#: A start pushed back by a late one is waited for only up to a quarter of this past
#: its own slot (see ``lua/start.lua``).
MAX_IN_PROCESS_WAIT = 0.2
#: A waiting call whose only limit is one ``Concurrency`` waits this long (seconds) past
#: its expected turn for the turn to be handed over to it (``Check.handed``) before it
#: confirms its reservation as other calls do.
HANDOFF_WAIT = 0.5
#: ... and its deferred copy is due this long (seconds) before its expected turn, so that
#: it is blocking for the turn when the slot is handed over, not on its way.
HANDOFF_EARLY = 0.1
#: A copy of a call in line that waited in the park blocks only this long (seconds) for
#: its turn: a turn handed to it calls it in (``park.call_in``), so a copy that comes by
#: its estimate has had no turn yet, and confirms at once.
PARKED_WAIT = 0.05
#: A handed turn's short lease with less than this left (seconds) is renewed before the
#: body starts; with more, the renewer renews it this long before it runs out (or
#: halfway, if sooner): a body shorter than the short lease needs no renewal.
HANDOFF_RENEW_NOW = 0.3
#: A grant read too late to start on (see ``Check.start``) is restamped at most this
#: many times in a row; then the task is published again, for a less busy moment.
MAX_RESTAMPS = 5


_last_logged: dict[str, float] = {}
_log_lock = threading.Lock()


def _log_at_most_every(interval: float, key: str) -> bool:
    """True if nothing was logged under ``key`` in the last ``interval`` seconds (and
    note that something is now): one line per cause and interval, not one per task."""
    with _log_lock:
        now = time.monotonic()
        last = _last_logged.get(key)
        if last is not None and now - last < interval:
            return False
        _last_logged[key] = now
        return True


class Check:
    """One execution's check: its keys and costs, its options (a message header of an
    option's name overrides the task's and the app's), and the steps of a decision."""

    def __init__(
        self, task: Any, plan: Plan, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        self.task, self.plan, self.args, self.kwargs = task, plan, args, kwargs
        self.request = task.request
        self.keys, self.costs, self.limits = plan.resolve(args, kwargs)
        self.fair = plan.fair(args, kwargs) if plan.fairly else None
        here = _process_settings(task)
        self.limiter = here.limiter
        self.green = here.green
        self.metrics = here.metrics  # None unless ratelimit_metrics is on
        calls = vars(self.request)
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
        self.slots = tuple(limit for limit in self.limits if isinstance(limit, Concurrency))
        self.lease = _lease(task, self.request, here.concurrency_lease) if self.slots else None
        #: the call may be handed a turn: its only limit is one Concurrency
        self.handy = len(self.limits) == 1 and bool(self.slots)
        self.tolerance = start_tolerance(self.limits, self.guard)
        self.sent = 0.0  # time.monotonic() when the last decision was asked for
        self.lead = 0.0  # how long after its decision the last grant was counted
        self.restamps = 0

    @property
    def parking(self) -> Any:
        """The app whose park may hold copies of calls in line (None: parking is off)."""
        return self.task.app if _process_settings(self.task).park_after is not None else None

    def setting(self, name: str) -> Any:
        return setting(name, self.task.app, self.task, self.request)

    def decide(self, token: str | None, restamp: bool = False, reserve: bool = False) -> Decision:
        """One limiter call: confirm the reservation ``token``, else acquire (reserving
        a slot when denied if ``reserve`` or ``ratelimit_reserve`` says so); or, with
        ``restamp``, start the grant ``token`` anew (see :meth:`start`)."""
        reserve = reserve or self.reserve
        self.mode = RESTAMP if restamp else CONFIRM if token else RESERVE if reserve else ACQUIRE
        self.restamps = self.restamps + 1 if restamp else 0
        limiter, keys, limits, costs = self.limiter, self.keys, self.limits, self.costs
        options: dict[str, Any] = {
            "horizon": self.max_countdown,
            "guard": self.guard,
            "hold": MAX_IN_PROCESS_WAIT,
            "lease": self.lease,
        }
        self.sent = time.monotonic()
        sent = time.time()
        fair: dict[str, Any] = {}
        if self.fair is not None:
            fair = {"fair": self.fair[0], "fair_weight": self.fair[1]}
        self.lead = lead(limits) if token is None and self.green else 0.0
        try:
            if token is None:
                decision = limiter.acquire(
                    keys, limits, costs, reserve=reserve, lead=self.lead, **options, **fair
                )
            elif restamp:
                decision = limiter.restamp(token, keys, limits, costs, **options)
            else:
                decision = limiter.confirm(token, keys, limits, costs, **options, **fair)
        except (LimiterUnavailable, LimiterMisconfigured):
            if self.metrics is not None:  # a failed or timed-out decision has a latency too
                self.metrics.latency.observe(max(time.time() - sent, 0.0))
            raise
        answered = time.time()
        observe(decision, sent, answered)
        if self.metrics is not None:
            elapsed = max(answered - sent, 0.0)
            self.metrics.decision(self.plan.limits, decision, elapsed, decision.allowed, self.mode)
            self.metrics.rates(limiter, keys, limits)
        return decision

    def handed(self, token: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the turn of the waiting call ``token`` to be
        handed over to it (a body that ends gives its slot to the first waiter: see
        ``lua/lib/concurrency.lua``). True: the slot is the call's and its body may start
        (held until it ends, see ``slots``), no decision asked for. False: no turn came,
        the call cannot be handed one (:attr:`handy`), or Redis failed: confirm as usual.
        """
        if not self.handy or self.lease is None:
            return False
        try:
            ends = self.limiter.handed(token, self.keys, self.limits, timeout)
        except (LimiterUnavailable, LimiterMisconfigured) as exc:
            logger.debug("ratelimit: could not wait for a handed turn: %s", exc)
            return False
        if ends is None:
            return False
        # how long its short lease has left, by Redis time; unknown (this process has not
        # measured its clock's offset yet): renewed before the body starts
        offset = clock._offset
        left = ends - time.time() - offset if offset is not None else 0.0
        held = self.hold(token, time.monotonic() + max(left - HANDOFF_RENEW_NOW, left / 2))
        if left < HANDOFF_RENEW_NOW:
            try:
                if not self.limiter.renew(held.token, held.keys, held.limits, lease=held.lease):
                    release(self.request)  # its lease ran out: the turn is lost
                    return False
            except (LimiterUnavailable, LimiterMisconfigured):
                pass  # the renewer tries again
            held.due = None
        setattr(self.request, DECISION_ATTR, Decision(True, 0, 0.0, 0.0, token=token, at=ends))
        if self.metrics is not None:
            self.metrics.handed(self.plan.limits)
        return True

    def hold(self, token: str, due: float | None = None) -> Held:
        """Note that the body holds its concurrency slots until it ends (see ``slots``);
        ``due``: time.monotonic() by which their lease must first be renewed."""
        assert self.lease is not None
        lease = min(slot.lease or self.lease for slot in self.slots)
        keys = self.keys[-len(self.slots) :]
        bare = token.partition(".")[0]
        held = Held(self.limiter, keys, self.slots, bare, lease, due=due, app=self.parking)
        hold(self.request, held)
        return held

    def start(self, decision: Decision) -> float:
        """Let the body run, after the in-process wait the limiter counted (if any):
        returns 0.0; or, if the body would start too late for its grant, how late.

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
        if late > self.tolerance and decision.token is not None:
            if self.metrics is not None:
                self.metrics.late_start(self.plan.limits)
            return late
        setattr(self.request, DECISION_ATTR, decision)
        if self.slots and decision.token is not None and self.lease is not None:
            self.hold(decision.token)  # held until the body ends (see slots)
        return 0.0

    def report_misconfigured(self, exc: LimiterMisconfigured) -> None:
        if self.metrics is not None:
            self.metrics.redis_error(self.plan.limits)
        interval = setting("ratelimit_warning_interval", self.task.app)
        # once per cause: what Redis answered, not the message (the first one says it
        # was the limiter's first call, the next ones a decision)
        cause = exc.__cause__ or exc
        if _log_at_most_every(interval, f"misconfigured:{type(cause).__name__}:{cause}"):
            logger.error(
                "ratelimit: %s. Every rate-limited task fails until this is fixed "
                "(%s[%s] now; next report in %.0fs at the earliest)",
                exc,
                self.task.name,
                self.request.id,
                interval,
            )

    def on_unavailable(self, exc: LimiterUnavailable) -> float | None:
        """The countdown to defer by under the task's Redis-error policy ("defer"), or
        None to run without the limit ("allow"); raises ``exc`` under "raise"."""
        if self.metrics is not None:
            self.metrics.redis_error(self.plan.limits)
        policy = _redis_error_policy(self.task, self.plan, self.request)
        if policy == "raise":
            raise exc
        interval = setting("ratelimit_warning_interval", self.task.app)
        countdown: float = self.setting("ratelimit_redis_error_countdown")
        if _log_at_most_every(interval, f"unavailable:{policy}"):
            name = self.task.name
            logger.warning(
                "ratelimit: Redis unavailable (%s); %s (ratelimit_on_redis_error=%r; "
                "next warning in %.0fs at the earliest)",
                exc,
                f"running without its rate limit: {name}"
                if policy == "allow"
                else f"deferring {name} by {countdown:g}s",
                policy,
                interval,
            )
        return None if policy == "allow" else countdown

    @property
    def competing(self) -> bool:
        """The last decision was this task competing for budget (it held no slot)."""
        return self.mode in (ACQUIRE, RESERVE)

    def give_back(self, token: str | None) -> None:
        """Release the reservation ``token``: a slot that cannot be given back only
        wastes budget."""
        if token:
            with contextlib.suppress(LimiterUnavailable, LimiterMisconfigured):
                handed = self.limiter.release_handing(token, self.keys, self.limits, self.costs)
                call_in_handed(self.parking, self.limiter, handed)


@dataclass(frozen=True)
class _ProcessSettings:
    """A task's options from the task and ``app.conf``, resolved once per process
    (``setting`` costs a few microseconds a lookup, on every task otherwise)."""

    pid: int
    limiter: Limiter
    max_countdown: float
    guard: float
    reserve: bool
    metrics: Any
    park_after: float | None  # an app-wide setting: every node's mover must agree
    concurrency_lease: float
    green: bool  # a gevent or eventlet pool: this process's sockets are theirs


def _process_settings(task: Any) -> _ProcessSettings:
    cls = type(task)
    cached = cls.__dict__.get("_ratelimit_settings")
    if cached is not None and cached.pid == os.getpid():
        return cached  # type: ignore[no-any-return]
    app = task.app
    resolved = _ProcessSettings(
        pid=os.getpid(),
        limiter=limiter_for(app),
        max_countdown=setting("ratelimit_max_countdown", app, task),
        guard=setting("ratelimit_guard", app, task),
        reserve=setting("ratelimit_reserve", app, task),
        metrics=metrics_for(app),
        park_after=park_after(app),
        concurrency_lease=setting("ratelimit_concurrency_lease", app, task),
        green=bool(_pool()),
    )
    cls._ratelimit_settings = resolved
    return resolved


@functools.lru_cache(maxsize=1024)
def start_tolerance(limits: tuple[Limit | Concurrency, ...], guard: float) -> float:
    """How late (seconds) a body may start after its grant without a restamp: half the
    slack ``guard`` adds to the tightest window (``lua/lib/log.lua``: starts are
    checked in windows that much wider than the limit's). With no guard, or with the
    counter (which keeps no entry to move), starts are not checked: ``inf``."""
    rates = [limit for limit in limits if isinstance(limit, Limit) and limit.align is None]
    if guard <= 0 or not rates or rates[0].algorithm != "log":
        return float("inf")
    return min(min(guard, limit.fixed_rate.window_us / 25_000_000) for limit in rates) / 2


def _lease(task: Any, request: Any, default: float) -> float:
    """A concurrency slot's lease: the call's or the task's hard time limit (a body
    cannot outlive it), else ``ratelimit_concurrency_lease``."""
    limits = getattr(request, "timelimit", None) or (None, None)
    hard = limits[0] or getattr(task, "time_limit", None)
    return float(hard) if hard else default


def _redis_error_policy(task: Any, plan: Plan, request: Any) -> str:
    own = getattr(request, "ratelimit_on_redis_error", None)
    if own is None:
        for limit in plan.limits:
            if limit.on_redis_error is not None:
                own = limit.on_redis_error
                break
    if own is not None:
        return str(own)
    return str(setting("ratelimit_on_redis_error", task.app, task, request))
