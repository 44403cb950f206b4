"""``explain TASK``: which limits one call of a task meets, their keys, and a peeked
decision, resolved as a worker would (nothing is counted)."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._celery.install import from_rules
from .._engine.decision import Decision
from .._engine.exceptions import InvalidLimit
from .._engine.fair import Place, place_of
from .._engine.layout import KeyName, parse_key
from .._engine.limit import AnyLimit, Concurrency
from .._engine.limiter import REDIS_ERRORS, Limiter
from .ops import (
    KeySettings,
    KeyStatus,
    app_tasks,
    guard_for_app,
    key_settings,
    key_status,
    limiter_for_app,
    override_in_force,
    pace_in,
    server_now_us,
    task_limits,
)
from .report import format_settings, in_seconds


@dataclass
class LimitExplanation:
    limit: AnyLimit
    key: str
    redis_key: str
    cost: int
    state: KeyStatus


@dataclass
class Explanation:
    """Which limits apply to one call of a task, their keys, and a peeked decision."""

    task: str
    source: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    limits: list[LimitExplanation] = field(default_factory=list)
    decision: Decision | None = None
    error: str | None = None
    settings: list[KeySettings] = field(default_factory=list)
    place: Place | None = None


def parse_value(text: str) -> Any:
    """A command-line argument: JSON when it parses (``3``, ``"x"``, ``[1]``), else the text."""
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def explain(
    app: Any,
    task_name: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    limiter: Limiter | None = None,
) -> Explanation:
    """Resolve the limits of ``task_name(*args, **kwargs)`` as a worker would; peek
    (on ``limiter``, default: the app's; it is closed at the end).

    Raises:
        KeyError: no such task (the message lists the rate-limited ones).
        LimiterUnavailable / LimiterMisconfigured: Redis failed (see ``failures``).
    """
    from .._celery.plan import plan_for

    task = _task(app, task_name)
    kwargs = dict(kwargs or {})
    result = Explanation(task_name, "", tuple(args), kwargs)
    plan = plan_for(task)
    if plan is None:
        result.source = "none: this task is not rate limited"
    elif from_rules(task):
        result.source = "app.conf.ratelimit_rules (install)"
    else:
        result.source = "the task's ratelimit option"
    result.error = binding_error(task, task_name, result.args, kwargs)
    if plan is None or result.error:
        return result
    try:
        keys, costs, limits = plan.resolve(tuple(args), kwargs)
        fair = plan.fair(tuple(args), kwargs)
    except (InvalidLimit, TypeError) as exc:
        result.error = f"a worker would fail this call: {exc}"
        return result
    limiter = limiter or limiter_for_app(app)
    redis_keys = limiter.keys_for(keys, limits)
    guard = guard_for_app(app)
    try:
        now = server_now_us(limiter.client)
        result.settings = key_settings(limiter)
        result.limits = _each_limit(
            limiter, result.settings, keys, redis_keys, costs, limits, guard, now
        )
        result.decision = limiter.peek((), limits, costs, guard=guard, redis_keys=redis_keys)
        if fair is not None:
            result.place = place_of(limiter.client, redis_keys[0], *fair, costs[0], now)
    except REDIS_ERRORS as exc:
        raise limiter.translate(exc, "explain") from exc
    finally:
        limiter.client.close()
    return result


def _task(app: Any, task_name: str) -> Any:
    """The app's task ``task_name``.

    Raises:
        KeyError: no such task (the message lists the rate-limited ones).
    """
    tasks = app_tasks(app)
    task = tasks.get(task_name)
    if task is None:
        limited = sorted(n for n, t in tasks.items() if task_limits(t))
        raise KeyError(
            f"no task {task_name!r} in app {app.main!r}; rate-limited tasks: "
            f"{', '.join(limited) or 'none'}"
        )
    return task


def _each_limit(
    limiter: Limiter,
    settings: list[KeySettings],
    keys: Sequence[str],
    redis_keys: Sequence[str],
    costs: Sequence[int],
    limits: Sequence[AnyLimit],
    guard: float,
    now: int,
) -> list[LimitExplanation]:
    """Each limit of the call: its key's state (an override applied as the scripts
    apply it) and what a peek at it alone answers."""
    overrides = {row.key: row.override for row in settings if row.override}
    rated = Counter(
        k for k, limit in zip(keys, limits, strict=True) if not isinstance(limit, Concurrency)
    )
    each = []
    for limit, key, redis_key, cost in zip(limits, keys, redis_keys, costs, strict=True):
        window = 0 if isinstance(limit, Concurrency) else limit.fixed_rate.window_us
        name = parse_key(limiter.prefix, redis_key) or KeyName(redis_key, key, limit.kind, window)
        override = override_in_force(overrides.get(key), name, rated[key] == 1)
        state = key_status(limiter.client, name, now, override)
        state.limit = limit
        one = limiter.peek((), (limit,), cost, guard=guard, redis_keys=[redis_key])
        state.remaining, state.next_free = one.remaining, one.retry_after
        state.pace_in = pace_in(limiter.client, name, limit, now, override)
        each.append(LimitExplanation(limit, key, redis_key, cost, state))
    return each


def binding_error(
    task: Any, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> str | None:
    """Why ``task(*args, **kwargs)`` cannot be called (the arguments do not fit its
    signature: Celery refuses such a call when it is sent, or with ``typing=False``
    the worker fails it), or None."""
    try:
        signature = inspect.signature(task.run).replace(return_annotation=inspect.Signature.empty)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        who = "Celery would refuse" if getattr(task, "typing", True) else "a worker would fail"
        return f"{who} this call: its arguments do not fit {name}{signature}: {exc}"
    return None


def _call(task: str, args: Iterable[Any], kwargs: Mapping[str, Any]) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{task}({', '.join(parts)})"


def format_explanation(
    e: Explanation, *, reserve: bool = True, max_countdown: float = float("inf")
) -> list[str]:
    """The lines ``explain`` prints."""
    lines = [f"call      {_call(e.task, e.args, e.kwargs)}", f"limits    {e.source}"]
    if e.error:
        return [*lines, f"error     {e.error}"]
    for i, item in enumerate(e.limits, 1):
        s = item.state
        if isinstance(item.limit, Concurrency):
            lines += [
                f"  {i}. {item.limit.label}  (at most {item.limit.n} running at once)",
                f"     key        {item.key}",
                f"     redis key  {item.redis_key}",
                f"     now        {s.used} running, {s.reservations} waiting for a turn;"
                f" a slot {in_seconds(s.next_free or 0.0)}",
            ]
            continue
        lines += [
            f"  {i}. {item.limit.label}  ({item.limit.fixed_rate}, {item.limit.kind}, "
            f"cost {item.cost})",
            f"     key        {item.key}",
            f"     redis key  {item.redis_key}",
            f"     now        used {s.used}/{(s.override or item.limit.fixed_rate).limit}"
            f" ({s.reservations} reserved slot(s)), remaining {s.remaining};"
            f" this cost fits {in_seconds(s.next_free or 0.0)}",
        ]
        if s.override is not None:
            lines.append(
                f"     overridden {s.override} (declared {item.limit.fixed_rate}): "
                "what every decision on the key counts against until unset"
            )
        if s.pace_in is not None:
            rate = item.limit.fixed_rate
            lines.append(
                f"     pace       burst {getattr(item.limit, 'burst', None)}, then one unit "
                f"every {rate.window_us / rate.limit / 1e6:g}s; the next unit conforms "
                f"{in_seconds(s.pace_in)}"
            )
    d = e.decision
    if d is None:
        return lines
    keys = {item.key for item in e.limits}
    lines += format_settings([row for row in e.settings if row.key in keys])
    if e.place is not None:
        p = e.place
        lines.append(
            f"fair      key {p.value} (weight {p.weight:g}): {p.waiting} call(s) wait for a "
            f"slot; one of this call's, if it must wait, is placed after {p.ahead} of them"
        )
    if d.allowed:
        lines.append(f"decision  allowed now ({d.remaining} free before this call)")
    else:
        by = (
            "a pause of its key (an upstream's 429)"
            if d.paused
            else d.limit.label
            if d.limit is not None
            else "the limits"
        )
        if d.retry_after > max_countdown:
            then = (
                f"by {max_countdown:g}s, the ratelimit_max_countdown cap, without a "
                "reservation, to compete again then"
            )
        else:
            then = "to that instant, reserving it" if reserve else "without a reservation"
        lines.append(
            f"decision  denied by {by}: it fits {in_seconds(d.retry_after)}; a worker would "
            f"defer it {then}"
        )
    lines.append("          (peek: nothing was counted)")
    return lines


__all__ = ["Explanation", "LimitExplanation", "explain", "format_explanation", "parse_value"]
