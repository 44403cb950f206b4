"""RateLimitedTask: before_start -> one limiter call -> run, or defer without losing the task.

The check runs in ``Task.before_start``. Celery (>= 5.2) calls it inside the same
``try`` that handles ``Retry``, ``Ignore`` and ``Reject``, so raising ``Retry`` there
ends this execution cleanly (state ``RETRY``) and the body never runs. A
``task_prerun`` signal handler could not do this: its exceptions are logged and
swallowed.

A denied call is published again as the same task (same id, args, kwargs, links,
chain, chord, group, queue, priority, expires) for the limiter's retry-after (an
``eta`` in Redis time, which the receiving worker moves to its own clock: see
``clock``), ``retries`` unchanged, and headers: ``ratelimit_deferrals`` (how many
times this task was deferred), ``ratelimit_denials`` (how many of those it could not
get budget: denied while it held no slot, or Redis unreachable;
``ratelimit_max_deferrals`` counts these) and
``ratelimit_token`` (its reserved slot, if any).
A third, ``ratelimit_retries``, tells a user's ``self.retry()`` of a deferred task (which
copies every header) from a deferral: the retry counts its own deferrals afresh.
The copy is published *before* the original message is acknowledged: a crash in
between can duplicate a message, never lose one.

The Decision that let a body run (``request.ratelimit_decision``) and the body's
concurrency slots are kept beside its request, never in it (:class:`Beside`).
"""

from __future__ import annotations

import logging
import secrets
import weakref
from collections.abc import Mapping
from typing import Any

from celery import Task, signals
from celery.app.task import Context
from celery.exceptions import Retry

from .._engine.decision import Decision
from .._engine.exceptions import (
    LimiterMisconfigured,
    LimiterUnavailable,
    RateLimitError,
)
from .._engine.headers import Observation
from .._engine.keys import escape_key
from .._engine.limit import to_limits
from .._engine.upstream import UpstreamRateLimited
from .check import DECISION_ATTR, DEFERRALS_HEADER, TOKEN_HEADER, _process_settings
from .defer import Deferral, defer
from .path import Path, enforce
from .plan import check_key_fields, plan_for
from .settings import check_app_settings, check_task_options, limiter_for
from .slots import SLOT_ATTR, release

logger = logging.getLogger("celery_ratelimit")

#: Each request a value was set on, by its handle (gone with the request).
_requests: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
#: The values kept for a request, by name (gone with the request).
_values: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


class Beside:
    """``request.<name>``: a value kept beside the request, never in it (None if none).

    Celery copies a request's attributes into message headers: building a new request
    context from an old one (``Task.__call__`` does, when the worker has not optimized it
    away) makes every attribute that is not one of ``Context``'s own a "custom header", and
    ``self.retry()``, ``replace()`` and stamping publish those headers. A ``Decision`` (or
    a concurrency slot's lease) set there cannot be serialized, and the retry fails.

    So ``request.<name>`` for such a value is a data descriptor set on Celery's
    ``Context`` class (:func:`attach`): the name becomes one of ``Context``'s own, which
    Celery leaves out of custom headers, and the request itself holds only a handle under
    it, a random string. The value is kept in this process, keyed by the request it was
    set on, and goes when that request does. A copy of the context carries the handle and
    reads the same value while the original lives; a handle that travelled anyway (a
    Celery that copied it into a message) is a plain string that names nothing in another
    execution.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, request: Any, owner: type | None = None) -> Any:
        if request is None:
            return self
        handle = request.__dict__.get(self.name)
        origin = _requests.get(handle) if isinstance(handle, str) else None
        if origin is None:
            return None
        return _values.get(origin, {}).get(self.name)

    def __set__(self, request: Any, value: Any) -> None:
        handle = request.__dict__.get(self.name)
        if not isinstance(handle, str) or _requests.get(handle) is not request:
            handle = secrets.token_hex(8)
            _requests[handle] = request
        _values.setdefault(request, {})[self.name] = value
        request.__dict__[self.name] = handle

    def __delete__(self, request: Any) -> None:
        self.__set__(request, None)


def attach(name: str) -> None:
    """Make ``request.<name>`` a value kept beside each request (once per name)."""
    if not isinstance(Context.__dict__.get(name), Beside):
        setattr(Context, name, Beside(name))


attach(DECISION_ATTR)
attach(SLOT_ATTR)


def call_body(task: Any, body: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``body``; if it raises ``UpstreamRateLimited``, pause the task's keys and
    publish the task again after the pause (:func:`after_upstream`)."""
    while True:
        try:
            return body(*args, **kwargs)
        except UpstreamRateLimited as exc:
            if not after_upstream(task, exc, args, kwargs):
                raise
            # the copy could not be published and this process waited out the pause
            # instead: check the limits again, then run the body again
            enforce(task, args, kwargs)


def after_upstream(
    task: Any, exc: UpstreamRateLimited, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> bool:
    """Pause the keys ``exc`` names (the task's limit keys by default) on every worker
    for its retry-after, give back this body's concurrency slots, and publish the task
    again on a slot reserved past the pause, its retries untouched.

    Returns False when there is nothing to defer (an eager call, a task without
    limits): the exception is the caller's. True when the copy could not be published
    and this process waited instead (see ``defer``).

    Raises:
        Retry: published (the usual end).
        Reject: the publish failed and the task is ``acks_late``.
    """
    request = task.request
    here = _process_settings(task)
    plan = here.plan
    if request.is_eager or request.called_directly or plan is None:
        return False
    check = Path(task, here, tuple(args), kwargs)
    keys = [escape_key(exc.key)] if exc.key else list(check.keys)
    try:
        if exc.key:
            check.limiter.pause_keys(keys, exc.seconds)
        else:  # the pause and, for adapt=True limits, a cut of the rate: one call
            granted = getattr(request, DECISION_ATTR, None)
            since = granted.at if granted is not None and granted.token else None
            check.limiter.observed(keys, Observation(exc.seconds), check.limits, since=since)
    except (LimiterUnavailable, LimiterMisconfigured) as error:
        logger.warning(
            "ratelimit: %s[%s]: could not pause %s (%s); deferring the task only",
            task.name,
            request.id,
            ", ".join(keys),
            error,
        )
    if check.metrics is not None:
        check.metrics.pause(plan.limits)
    release(request)
    reason = f"upstream rate limited: {', '.join(keys)} paused for {exc.seconds:g}s"
    try:
        decision = check.ask(None, reserve=True)
    except (LimiterUnavailable, LimiterMisconfigured):
        decision = None
    if decision is not None and decision.reserved:
        countdown, token = decision.retry_after, decision.token
    else:
        if decision is not None and decision.allowed:
            check.give_back(decision.token)
        countdown, token = exc.seconds, None
    defer(check, Deferral(min(countdown, check.max_countdown), token, reason, why="upstream"))
    return True


class RateLimitedTask(Task):  # type: ignore[misc]
    """A Celery task whose executions share one rate limit across every worker node.

    Options (as ``@app.task(base=RateLimitedTask, ...)`` keywords or class attributes):

    - ``ratelimit``: a rate string (``"10/s"``), a :class:`Limit`, a
      :class:`Concurrency`, or a list of them (checked all or nothing). Keys are
      templates formatted from the call's arguments (``Limit("100/m",
      key="api:{tenant}")``); the default key is the task name.
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
        name = cls.__dict__.get("name") or cls.__name__
        check_task_options(cls, f"task {name}")
        spec = cls.__dict__.get("ratelimit")
        if spec is not None:
            cls.ratelimit = checked_limits(cls, spec, f"ratelimit of task {name}")

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Celery binds each task to its app (``app.finalize()``, a worker's start):
        the app's ``ratelimit_*`` settings are checked then, with or without
        ``install(app)``, not when the first task runs."""
        super().on_bound(app)
        check_app_settings(app)

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Check the shared limit before the body runs; defer (``Retry``) if denied."""
        try:
            enforce(self, args, kwargs)
        except Retry as exc:
            # raised again with a fresh traceback: Celery's pool copies every frame of a
            # Retry's traceback (each frame's code positions, 600-700 for enforce and
            # defer each), formats it and pickles it to the node's main process;
            # the frames below this one would cost milliseconds of CPU a deferral
            raise exc.with_traceback(None) from None
        super().before_start(task_id, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body; an ``UpstreamRateLimited`` it raises pauses the task's keys
        and defers the task past the pause (``Retry``)."""
        return call_body(self, super().__call__, args, kwargs)


def checked_limits(cls: Any, spec: Any, what: str = "limits") -> tuple[Any, ...]:
    """The task class's limits, normalized, their key templates checked against its
    signature.

    Celery builds an ``@app.task`` class when its proxy is first used, inside the proxy's
    ``except AttributeError`` (``celery.local.PromiseProxy``): an error raised here would
    come chained after that AttributeError, which says nothing of the mistake. It is
    raised alone.

    Raises:
        InvalidRate, InvalidLimit: a bad rate or limit, or a key template naming an
            argument that no call of the task can have.
    """
    try:
        limits = to_limits(spec, what)
        check_key_fields(cls, limits)
    except RateLimitError as exc:
        raise exc from None
    return limits


def wrap_before_start(cls: Any) -> None:
    """Make a plain task class enforce its ``ratelimit`` in ``before_start`` (its key
    templates checked against the task's signature first).

    Used by the ``ratelimit`` decorator and by ``install``: the method is set on the
    task's own class (Celery looks it up there when it builds the task's tracer); an
    existing ``before_start`` still runs, after the check.
    """
    checked_limits(cls, cls.ratelimit)
    check_task_options(cls, f"task {cls.__dict__.get('name') or cls.__name__}")
    if issubclass(cls, RateLimitedTask) or cls.__dict__.get("_ratelimit_wrapped"):
        return
    original = cls.before_start

    def before_start(
        self: Any, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            enforce(self, args, kwargs)
        except Retry as exc:
            raise exc.with_traceback(None) from None  # see RateLimitedTask.before_start
        original(self, task_id, args, kwargs)

    before_start.__doc__ = RateLimitedTask.before_start.__doc__
    cls.before_start = before_start
    own = cls.__dict__.get("__call__")

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Task.__call__ looked up at call time: a worker replaces it with one that
        # keeps the request it pushed (celery.app.trace._install_stack_protection)
        body = own.__get__(self) if own is not None else super(cls, self).__call__
        return call_body(self, body, args, kwargs)

    __call__.__doc__ = RateLimitedTask.__call__.__doc__
    cls.__call__ = __call__
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
        keys, costs, limits = plan.resolve(tuple(request.args or ()), request.kwargs or {})
        limiter = limiter_for(task.app)
        limiter.release(token, keys, limits, costs)
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
