"""What a task's path (``path``) works out once per process (its plan, options and
prepared limiter call: :func:`_process_settings`), and the steps it takes besides the
decision: a handed turn, held concurrency slots, and the handling of a Redis failure
under the task's policy. The deferral is ``defer``'s; the message headers it writes are
named here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from celery.app.task import Context

from .._engine.decision import Decision
from .._engine.exceptions import LimiterMisconfigured, LimiterUnavailable, RateLimitError
from .._engine.limit import Concurrency, Limit
from .._engine.limiter import Limiter
from .._engine.scripts import Prepared
from . import clock
from .green import _pool
from .metrics import metrics_for
from .plan import Plan, plan_for
from .settings import limiter_for, park_after, setting
from .slots import Held, hold, release

if TYPE_CHECKING:
    from .path import Path

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
DECISION_ATTR = "ratelimit_decision"  # task.Beside
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
#: its expected turn for the turn to be handed over to it (``check.handed``) before it
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
#: A grant read too late to start on (see ``Path.started``) is restamped at most this
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


def handed(path: Path, token: str, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the turn of the waiting call ``token`` to be
    handed over to it (a body that ends gives its slot to the first waiter: see
    ``lua/lib/concurrency.lua``). True: the slot is the call's and its body may start
    (held until it ends, see ``slots``), no decision asked for. False: no turn came,
    the call cannot be handed one (:attr:`handy`), or Redis failed: confirm as usual.
    """
    if not path.handy or path.lease is None:
        return False
    try:
        ends = path.limiter.handed(token, path.keys, path.limits, timeout)
    except (LimiterUnavailable, LimiterMisconfigured) as exc:
        logger.debug("ratelimit: could not wait for a handed turn: %s", exc)
        return False
    if ends is None:
        return False
    # how long its short lease has left, by Redis time; unknown (this process has not
    # measured its clock's offset yet): renewed before the body starts
    offset = clock._offset
    left = ends - time.time() - offset if offset is not None else 0.0
    held = hold_slots(path, token, time.monotonic() + max(left - HANDOFF_RENEW_NOW, left / 2))
    if left < HANDOFF_RENEW_NOW:
        try:
            if not path.limiter.renew(held.token, held.keys, held.limits, lease=held.lease):
                release(path.request)  # its lease ran out: the turn is lost
                return False
        except (LimiterUnavailable, LimiterMisconfigured):
            pass  # the renewer tries again
        held.due = None
    setattr(path.request, DECISION_ATTR, Decision(True, 0, 0.0, 0.0, token=token, at=ends))
    if path.metrics is not None:
        path.metrics.handed(path.plan.limits)
    return True


def hold_slots(path: Path, token: str, due: float | None = None) -> Held:
    """Note that the body holds its concurrency slots until it ends (see ``slots``);
    ``due``: time.monotonic() by which their lease must first be renewed."""
    assert path.lease is not None
    lease = min(slot.lease or path.lease for slot in path.slots)
    keys = path.keys[-len(path.slots) :]
    bare = token.partition(".")[0]
    held = Held(path.limiter, keys, path.slots, bare, lease, due=due, app=path.parking)
    hold(path.request, held)
    return held


def report_misconfigured(path: Path, exc: LimiterMisconfigured) -> None:
    if path.metrics is not None:
        path.metrics.redis_error(path.plan.limits)
    interval = setting("ratelimit_warning_interval", path.task.app)
    # once per cause: what Redis answered, not the message (the first one says it
    # was the limiter's first call, the next ones a decision)
    cause = exc.__cause__ or exc
    if _log_at_most_every(interval, f"misconfigured:{type(cause).__name__}:{cause}"):
        logger.error(
            "ratelimit: %s. Every rate-limited task fails until this is fixed "
            "(%s[%s] now; next report in %.0fs at the earliest)",
            exc,
            path.task.name,
            path.request.id,
            interval,
        )


def on_unavailable(path: Path, exc: LimiterUnavailable) -> float | None:
    """The countdown to defer by under the task's Redis-error policy ("defer"), or
    None to run without the limit ("allow"); raises ``exc`` under "raise"."""
    if path.metrics is not None:
        path.metrics.redis_error(path.plan.limits)
    policy = _redis_error_policy(path.task, path.plan, path.request)
    if policy == "raise":
        raise exc
    interval = setting("ratelimit_warning_interval", path.task.app)
    countdown: float = path.setting("ratelimit_redis_error_countdown")
    if _log_at_most_every(interval, f"unavailable:{policy}"):
        name = path.task.name
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


@dataclass(frozen=True)
class _ProcessSettings:
    """A task's plan and options (from the task and ``app.conf``), resolved once per
    process (``setting`` costs a few microseconds a lookup, on every task otherwise),
    and what its path works out from them once: its concurrency limits, the start
    tolerance and the limiter call of an acquisition, prepared."""

    pid: int
    spec: Any  # the task's ``ratelimit`` these are for
    plan: Plan | None  # None: the task has no limits
    limiter: Limiter
    max_countdown: float
    guard: float
    reserve: bool
    metrics: Any
    park_after: float | None  # an app-wide setting: every node's mover must agree
    concurrency_lease: float
    green: bool  # a gevent or eventlet pool: this process's sockets are theirs
    slots: tuple[Concurrency, ...] = ()
    handy: bool = False  # the call may be handed a turn: its only limit is one Concurrency
    tolerance: float | None = None  # start_tolerance at ``guard``; None: per call
    prepared: Prepared | None = None  # the acquisition of a call with ``options``
    options: tuple[float, float, float | None] = (0.0, 0.0, None)  # horizon, guard, lease


def _process_settings(task: Any) -> _ProcessSettings:
    """The task's :class:`_ProcessSettings` in this process (``path.enforce`` reads the
    cached ones itself)."""
    cls = type(task)
    cached = cls.__dict__.get("_ratelimit_settings")
    spec = getattr(task, "ratelimit", None)
    if cached is not None and cached.pid == os.getpid() and cached.spec is spec:
        return cached  # type: ignore[no-any-return]
    app = task.app
    resolved = _ProcessSettings(
        pid=os.getpid(),
        spec=spec,
        plan=plan_for(task),
        limiter=limiter_for(app),
        max_countdown=setting("ratelimit_max_countdown", app, task),
        guard=setting("ratelimit_guard", app, task),
        reserve=setting("ratelimit_reserve", app, task),
        metrics=metrics_for(app),
        park_after=park_after(app),
        concurrency_lease=setting("ratelimit_concurrency_lease", app, task),
        green=bool(_pool()),
    )
    if resolved.plan is not None:
        resolved = _prepared(task, resolved, resolved.plan)
    cls._ratelimit_settings = resolved
    return resolved


def _prepared(task: Any, here: _ProcessSettings, plan: Plan) -> _ProcessSettings:
    """``here`` with what a call's path works out once: see :class:`_ProcessSettings`.
    An acquisition is prepared when every call of the task sends the same limits and
    costs with no fair share."""
    slots = tuple(limit for limit in plan.limits if isinstance(limit, Concurrency))
    lease = _lease(task, None, here.concurrency_lease) if slots else None
    options = (here.max_countdown, here.guard, lease)
    constant = plan.constant
    tolerance = prepared = None
    if constant is not None:
        limits, costs = constant
        tolerance = start_tolerance(limits, here.guard)
        if not plan.fairly:
            with contextlib.suppress(RateLimitError, TypeError):  # the call says it
                prepared = here.limiter._prepare_acquire(
                    limits,
                    costs,
                    horizon=options[0],
                    guard=options[1],
                    hold=MAX_IN_PROCESS_WAIT,
                    lease=lease,
                )
    handy = len(plan.limits) == 1 and bool(slots)
    return replace(
        here,
        slots=slots,
        handy=handy,
        tolerance=tolerance,
        prepared=prepared,
        options=options,
    )


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
