"""RateLimitedTask: before_start -> one limiter call -> run, or defer without losing the task.

The check runs in ``Task.before_start``. Celery (>= 5.2) calls it inside the same
``try`` that handles ``Retry``, ``Ignore`` and ``Reject``, so raising ``Retry`` there
ends this execution cleanly (state ``RETRY``) and the body never runs. A
``task_prerun`` signal handler could not do this: its exceptions are logged and
swallowed.

A denied call is published again as the same task (same id, args, kwargs, links,
chain, chord, group, queue, priority, expires) for the limiter's retry-after (an
``eta`` in Redis time, which the receiving worker moves to its own clock: see
``_clock``), ``retries`` unchanged, and headers: ``ratelimit_deferrals`` (how many
times this task was deferred) and ``ratelimit_token`` (its reserved slot, if any).
A third, ``ratelimit_retries``, tells a user's ``self.retry()`` of a deferred task (which
copies every header) from a deferral: the retry counts its own deferrals afresh.
The copy is published *before* the original message is acknowledged: a crash in
between can duplicate a message, never lose one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery import Task, signals
from celery.exceptions import Reject, Retry
from celery.utils.time import maybe_iso8601

from ._clock import observe, redis_eta
from ._decision import Decision
from ._exceptions import (
    InvalidLimit,
    LimiterMisconfigured,
    LimiterUnavailable,
    RateLimitExceeded,
)
from ._keys import escape_key, render
from ._limit import Limit, check_cost, describe, to_limits
from ._limiter import ACQUIRE, CONFIRM, RELEASE, RESERVE, Limiter, token_bytes_of
from ._metrics import metrics_for, send_deferral_event
from ._settings import limiter_for, setting

logger = logging.getLogger("celery_ratelimit")

#: Message headers written on a deferral.
DEFERRALS_HEADER = "ratelimit_deferrals"
TOKEN_HEADER = "ratelimit_token"
#: ``request.retries`` of the execution that was deferred (see ``_token_header``).
RETRIES_HEADER = "ratelimit_retries"
#: Request attribute holding the Decision that let the task run.
DECISION_ATTR = "ratelimit_decision"
#: A start at most this far ahead (an early arrival, a reservation this close, a
#: late task waiting for the window) is waited for in-process instead of being
#: published again; the limiter counts it for that instant, so no second call follows.
#: Lateness spreads: a start pushed back by a late one pushes the start one window
#: later by as much, less half the guard. Measured on a loaded 2-vCPU machine (400
#: tasks at 20/s, three nodes, RabbitMQ): 100 ms left 1.95-2.5 calls per task, 40 ms
#: 2.6, 200 ms 1.95 in three of three runs (no task deferred twice).
MAX_IN_PROCESS_WAIT = 0.2
#: A deferred copy is due this long after its slot: clock offsets are measured to
#: about a millisecond, and a copy arriving a hair early would cost a wait and a
#: second confirmation, one arriving a hair late costs nothing.
ETA_MARGIN = 0.005


@dataclass(frozen=True)
class Plan:
    """What a task's limits need per call, worked out once per task class."""

    limits: tuple[Limit, ...]
    signature: inspect.Signature | None
    task_name: str
    #: keys and costs when no limit depends on the call's arguments (worked out once)
    fixed: tuple[tuple[str, ...], tuple[int, ...]] | None = None

    def resolve(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Escaped keys and costs for this call.

        Raises:
            InvalidLimit: a template names a missing argument, a key or cost function
                raised or returned something unusable, or a cost exceeds its limit.
            TypeError: a cost function returned a bool, a float or a non-number.
        """
        if self.fixed is not None:
            return self.fixed
        arguments: Mapping[str, Any] | None = None
        keys: list[str] = []
        costs: list[int] = []
        for limit in self.limits:
            key = limit.key
            if key is None:
                keys.append(escape_key(self.task_name))
            elif isinstance(key, str):
                if limit.fields:
                    if arguments is None:
                        arguments = self._bind(args, kwargs)
                    keys.append(render(key, arguments, args))
                else:
                    keys.append(escape_key(key))
            else:
                value = _call_user(key, f"key function of {limit.label}", args, kwargs)
                if not isinstance(value, str) or not value:
                    raise InvalidLimit(
                        f"key function of {limit.label} returned {value!r}, expected a "
                        "non-empty string"
                    )
                keys.append(escape_key(value))
            cost = limit.cost
            if callable(cost):
                cost = _call_user(cost, f"cost function of {limit.label}", args, kwargs)
            check_cost(cost, f"cost of {limit.label}")
            if cost > limit.rate.limit:
                raise InvalidLimit(
                    f"cost {cost} of {self.task_name} is greater than the limit "
                    f"{limit.label}: it could never run"
                )
            costs.append(cost)
        return tuple(keys), tuple(costs)

    def _bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
        """The call's arguments by name, defaults applied; a ``**kwargs`` parameter's
        keywords are named as they were passed (``{b}`` of ``t.delay(b=1)``)."""
        if self.signature is None:
            return dict(kwargs)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidLimit(
                f"cannot bind the arguments of {self.task_name} to build its rate-limit key: {exc}"
            ) from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for parameter in self.signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments = {**arguments.pop(parameter.name, {}), **arguments}
        return arguments


def _call_user(function: Any, what: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """``function(*args, **kwargs)``; what it raises fails the call as InvalidLimit,
    naming the function and its error."""
    try:
        return function(*args, **kwargs)
    except Exception as exc:
        raise InvalidLimit(f"{what} raised {type(exc).__name__}: {exc}") from exc


def run_signature(cls: Any) -> inspect.Signature | None:
    """The signature a call of task class ``cls`` binds to (``self`` left out)."""
    run = inspect.getattr_static(cls, "run", None)
    try:
        if isinstance(run, staticmethod):
            return inspect.signature(run.__func__)
        signature = inspect.signature(run)
    except (TypeError, ValueError):
        return None
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def check_key_fields(cls: Any, limits: tuple[Limit, ...]) -> None:
    """Refuse, when the task is declared, a key template naming an argument that no
    call of the task can have.

    Raises:
        InvalidLimit: naming the template, the field and the task's signature.
    """
    signature = run_signature(cls)
    if signature is None:
        return
    kinds = [parameter.kind for parameter in signature.parameters.values()]
    names = {
        parameter.name
        for parameter in signature.parameters.values()
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    positions = sum(
        kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for kind in kinds
    )
    for limit in limits:
        for field in limit.fields:
            if field.isdigit():
                possible = inspect.Parameter.VAR_POSITIONAL in kinds or int(field) < positions
            else:
                possible = field in names or inspect.Parameter.VAR_KEYWORD in kinds
            if not possible:
                name = getattr(cls, "name", None) or cls.__name__
                raise InvalidLimit(
                    f"key template {limit.key!r} of task {name} names argument {{{field}}}, "
                    f"which no call of it can have: its signature is {signature}"
                )


def plan_for(task: Any) -> Plan | None:
    """The task's Plan, or None if it has no ``ratelimit`` (or is a ``celery.*`` task)."""
    cls = type(task)
    spec = getattr(task, "ratelimit", None)
    cached = cls.__dict__.get("_ratelimit_plan")
    if cached is not None and cached[0] is spec:
        return cached[1]  # type: ignore[no-any-return]
    plan = None
    name = task.name or cls.__name__
    if spec is not None and not name.startswith("celery."):
        try:
            signature: inspect.Signature | None = inspect.signature(task.run)
        except (TypeError, ValueError):
            signature = None
        plan = Plan(to_limits(spec, f"ratelimit of task {name}"), signature, name)
        if not any(
            limit.fields or callable(limit.key) or callable(limit.cost) for limit in plan.limits
        ):
            plan = dataclasses.replace(plan, fixed=plan.resolve((), {}))
    cls._ratelimit_plan = (spec, plan)
    return plan


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


def enforce(task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Retry | None:
    """Let the task run now (returns None), or defer it and return the ``Retry`` that
    ``before_start`` must raise to end this execution.

    Returned, not raised: Celery turns the ``Retry`` into an ``ExceptionInfo`` that
    copies every frame of its traceback (billiard lists each frame's code positions,
    100 us for a function this size), so it is raised in ``before_start`` itself, two
    frames from where Celery catches it instead of four.

    Raises:
        RateLimitExceeded: deferred more than ``ratelimit_max_deferrals`` times.
        InvalidLimit: the call's key or cost cannot be worked out (the task fails).
        LimiterUnavailable: Redis is down and the policy is ``"raise"``.
        LimiterMisconfigured: Redis refuses the limiter (logged once per interval).
    """
    request = task.request
    if request.is_eager or request.called_directly:
        return None
    plan = plan_for(task)
    if plan is None:
        return None
    app = task.app
    keys, costs = plan.resolve(tuple(args), kwargs)
    here = _process_settings(task)
    calls = vars(request)  # a message header of an option's name overrides it
    max_countdown = (
        setting("ratelimit_max_countdown", app, task, request)
        if "ratelimit_max_countdown" in calls
        else here.max_countdown
    )
    guard = (
        setting("ratelimit_guard", app, task, request) if "ratelimit_guard" in calls else here.guard
    )
    reserve = (
        setting("ratelimit_reserve", app, task, request)
        if "ratelimit_reserve" in calls
        else here.reserve
    )
    token = _token_header(task, request)
    limiter = here.limiter
    metrics = here.metrics  # None unless ratelimit_metrics is on
    first = RESERVE if reserve else ACQUIRE
    while True:
        try:
            mode = CONFIRM if token else first
            sent = time.time()
            decision = limiter._call(
                keys,
                plan.limits,
                costs,
                mode,
                token=token,
                horizon=max_countdown,
                guard=guard,
                hold=MAX_IN_PROCESS_WAIT,
            )
        except LimiterMisconfigured as exc:
            if metrics is not None:
                metrics.redis_error(plan.limits)
            interval = setting("ratelimit_warning_interval", app)
            if _log_at_most_every(interval, str(exc)):
                logger.error(
                    "ratelimit: %s. Every rate-limited task fails until this is fixed "
                    "(%s[%s] now; next report in %.0fs at the earliest)",
                    exc,
                    task.name,
                    request.id,
                    interval,
                )
            raise
        except LimiterUnavailable as exc:
            if metrics is not None:
                metrics.redis_error(plan.limits)
            policy = _redis_error_policy(task, plan, request)
            if policy == "raise":
                raise
            interval = setting("ratelimit_warning_interval", app)
            countdown = setting("ratelimit_redis_error_countdown", app, task, request)
            if _log_at_most_every(interval, f"unavailable:{policy}"):
                logger.warning(
                    "ratelimit: Redis unavailable (%s); %s %s (ratelimit_on_redis_error=%r; "
                    "next warning in %.0fs at the earliest)",
                    exc,
                    "running without its rate limit:" if policy == "allow" else "deferring",
                    task.name if policy == "allow" else f"{task.name} by {countdown:g}s",
                    policy,
                    interval,
                )
            if policy == "allow":
                return None
            outcome = _defer(task, plan, keys, args, kwargs, countdown, None, f"Redis error: {exc}")
            if isinstance(outcome, Retry):
                return outcome
            token = outcome
            continue
        answered = time.time()
        observe(decision, sent, answered)
        if metrics is not None:
            elapsed = max(answered - sent, 0.0)
            metrics.decision(plan.limits, decision, elapsed, decision.allowed, mode)
        if decision.allowed:
            if decision.retry_after > 0:
                # Its start is moments away and already counted for that instant (the
                # limiter's hold): wait here rather than publish a copy and confirm.
                if metrics is not None and mode != CONFIRM:
                    metrics.held(plan.limits)
                time.sleep(decision.retry_after)
            setattr(request, DECISION_ATTR, decision)
            return None
        countdown = min(decision.retry_after, max_countdown)
        reason = (
            f"rate limited by {decision.limit.label if decision.limit else describe(plan.limits)}"
        )
        outcome = _defer(
            task,
            plan,
            keys,
            args,
            kwargs,
            countdown,
            decision.token if decision.reserved else None,
            reason,
            limiter,
            costs,
            denied_by=decision.limit,
        )
        if isinstance(outcome, Retry):
            return outcome
        token = outcome


def _token_header(task: Any, request: Any) -> str | None:
    """The message's reservation token; one the limiter did not write is no token (the
    task competes afresh), and a user's ``self.retry()`` of a deferred task starts
    afresh too: its copy carries the headers of the execution it retries."""
    if getattr(request, RETRIES_HEADER, request.retries) != request.retries:
        setattr(request, DEFERRALS_HEADER, 0)
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
    )
    cls._ratelimit_settings = resolved
    return resolved


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


def _defer(
    task: Any,
    plan: Plan,
    keys: tuple[str, ...],
    args: Any,
    kwargs: Any,
    countdown: float,
    token: str | None,
    reason: str,
    limiter: Limiter | None = None,
    costs: tuple[int, ...] | None = None,
    denied_by: Limit | None = None,
) -> Retry | str | None:
    """Publish the task again ``countdown`` seconds from now; return the ``Retry`` that
    ends this execution.

    When the publish failed and the task waited in this process instead (acks_early:
    the original message is already acknowledged), returns the token to confirm after
    that wait (or None) in place of the ``Retry``.
    """
    request = task.request
    app = task.app
    deferrals = int(getattr(request, DEFERRALS_HEADER, 0) or 0)
    max_deferrals = setting("ratelimit_max_deferrals", app, task, request)

    def give_back() -> None:
        if token and limiter is not None and costs is not None:
            with contextlib.suppress(LimiterUnavailable):
                limiter._call(keys, plan.limits, costs, RELEASE, token=token)

    if max_deferrals is not None and deferrals >= max_deferrals:
        give_back()
        raise RateLimitExceeded(
            f"{task.name}[{request.id}] was deferred {deferrals} times "
            f"(ratelimit_max_deferrals={max_deferrals}); giving up: {reason}"
        )
    if token and _expires_before(task, request, countdown):
        # Celery will end the copy as expired when it arrives; its slot would be wasted.
        give_back()
        token = None
    headers = {
        name: value
        for name, value in vars(request).items()
        if name.startswith("ratelimit_") and name != DECISION_ATTR
    }
    headers[DEFERRALS_HEADER] = deferrals + 1
    headers[TOKEN_HEADER] = token
    headers[RETRIES_HEADER] = request.retries
    signature = task.signature_from_request(
        request,
        args,
        kwargs,
        # in Redis time, since worker clocks may disagree (see _clock)
        eta=redis_eta(countdown + ETA_MARGIN),
        retries=request.retries,
        headers=headers,
    )
    try:
        signature.apply_async()
    except Exception as exc:
        if task.acks_late:
            logger.error(
                "ratelimit: could not re-publish %s[%s] (%s); rejecting it with requeue "
                "so the broker delivers it again",
                task.name,
                request.id,
                exc,
            )
            raise Reject(exc, requeue=True) from exc
        logger.error(
            "ratelimit: could not re-publish %s[%s] (%s); waiting %.3fs in this process "
            "instead, so the task is not lost",
            task.name,
            request.id,
            exc,
            countdown,
        )
        time.sleep(countdown)
        return token
    logger.info(
        "ratelimit: deferred %s[%s] key %s for %.3fs (deferral %d%s; %s)",
        task.name,
        request.id,
        ",".join(keys),
        countdown,
        deferrals + 1,
        ", slot reserved" if token else "",
        reason,
    )
    metrics = metrics_for(app)
    if metrics is not None:
        new_slot = bool(token) and token != getattr(request, TOKEN_HEADER, None)
        metrics.deferral(plan.limits, denied_by, new_slot)
    send_deferral_event(task, ",".join(keys), countdown, deferrals + 1, bool(token))
    return Retry(reason, when=countdown, sig=signature)


def _expires_before(task: Any, request: Any, countdown: float) -> bool:
    """True if the task's ``expires`` passes before ``countdown`` seconds from now."""
    expires = request.expires
    if not expires:
        return False
    try:
        when = maybe_iso8601(expires) if isinstance(expires, str) else expires
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        now = task.app.now()
        if now.tzinfo is None:
            now = now.replace(tzinfo=datetime.timezone.utc)
        return bool(when <= now + datetime.timedelta(seconds=countdown))
    except (TypeError, ValueError, AttributeError):
        return False


class RateLimitedTask(Task):  # type: ignore[misc]
    """A Celery task whose executions share one rate limit across every worker node.

    Options (as ``@app.task(base=RateLimitedTask, ...)`` keywords or class attributes):

    - ``ratelimit``: a rate string (``"10/s"``), a :class:`Limit`, or a list of Limits
      (checked all or nothing). Keys are templates formatted from the call's arguments
      (``Limit("100/m", key="api:{tenant}")``); the default key is the task name.
    - ``ratelimit_max_countdown``, ``ratelimit_max_deferrals``, ``ratelimit_reserve``,
      ``ratelimit_on_redis_error``: override the ``app.conf`` settings for this task.

    Example::

        @app.task(base=RateLimitedTask, ratelimit=Limit("100/m", key="yt:quota:{api_key}"))
        def fetch(api_key, region): ...
    """

    ratelimit: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Celery builds one subclass per @app.task: validate the option right there,
        # so a bad rate fails when the task is declared, not when it first runs.
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("ratelimit")
        if spec is not None:
            cls.ratelimit = to_limits(
                spec, f"ratelimit of task {cls.__dict__.get('name') or cls.__name__}"
            )
            check_key_fields(cls, cls.ratelimit)

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Check the shared limit before the body runs; defer (``Retry``) if denied."""
        retry = enforce(self, args, kwargs)
        if retry is not None:
            raise retry
        super().before_start(task_id, args, kwargs)


def wrap_before_start(cls: Any) -> None:
    """Make a plain task class enforce its ``ratelimit`` in ``before_start`` (its key
    templates checked against the task's signature first).

    Used by the ``ratelimit`` decorator and by ``install``: the method is set on the
    task's own class (Celery looks it up there when it builds the task's tracer); an
    existing ``before_start`` still runs, after the check.
    """
    check_key_fields(cls, to_limits(cls.ratelimit))
    if issubclass(cls, RateLimitedTask) or cls.__dict__.get("_ratelimit_wrapped"):
        return
    original = cls.before_start

    def before_start(
        self: Any, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        retry = enforce(self, args, kwargs)
        if retry is not None:
            raise retry
        original(self, task_id, args, kwargs)

    before_start.__doc__ = RateLimitedTask.before_start.__doc__
    cls.before_start = before_start
    cls._ratelimit_wrapped = True


def _release_on_revoke(request: Any = None, **_: Any) -> None:
    """A revoked or expired task gives its reserved slot back (if it had one)."""
    headers = getattr(request, "request_dict", None) or {}
    token = headers.get(TOKEN_HEADER)
    task = getattr(request, "task", None)
    if not token or task is None:
        return
    try:
        plan = plan_for(task)
        if plan is None:
            return
        keys, costs = plan.resolve(tuple(request.args or ()), request.kwargs or {})
        limiter = limiter_for(task.app)
        limiter._call(keys, plan.limits, costs, RELEASE, token=token)
    except Exception as exc:  # a slot that cannot be released only wastes budget
        logger.debug("ratelimit: could not release the slot of %s: %s", request.id, exc)


__all__ = [
    "DECISION_ATTR",
    "DEFERRALS_HEADER",
    "TOKEN_HEADER",
    "Decision",
    "RateLimitedTask",
    "enforce",
]

signals.task_revoked.connect(_release_on_revoke, weak=False)
