"""Plan: what a rate-limited task's limits need per call, worked out once per task class.

A call's keys come from the limits' templates formatted with the call's arguments bound
to the task's signature (or from key functions), its costs from ints or cost functions,
its rates from rate functions where a limit has one.
Templates are checked against the signature when the task is declared: a field that no
call can have is refused then, not at every call.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from .._engine.exceptions import InvalidLimit, InvalidRate
from .._engine.keys import escape_key, fixed_key, render
from .._engine.limit import AnyLimit, Concurrency, Limit, check_cost, check_weight, to_limits
from .compat import ProxyParts


class Call(NamedTuple):
    """What one call of a task checks: escaped keys, costs and its limits."""

    keys: tuple[str, ...]
    costs: tuple[int, ...]
    limits: tuple[AnyLimit, ...]


@dataclass(frozen=True)
class Plan:
    """What a task's limits need per call, worked out once per task class."""

    limits: tuple[AnyLimit, ...]
    signature: inspect.Signature | None
    task_name: str
    #: the call when no limit depends on the call's arguments (worked out once)
    fixed: Call | None = None

    def resolve(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Call:
        """Escaped keys, costs and limits (a rate function's rate in place) for this call.

        Raises:
            InvalidLimit: a template names a missing argument, a key, cost or rate
                function raised or returned something unusable, or a cost exceeds its limit.
            TypeError: a cost function returned a bool, a float or a non-number.
        """
        if self.fixed is not None:
            return self.fixed
        arguments: Mapping[str, Any] | None = None
        keys: list[str] = []
        costs: list[int] = []
        limits: list[AnyLimit] = []
        for limit in self.limits:
            rated = False
            if not isinstance(limit, Concurrency) and callable(limit.rate):
                limit, rated = _rated(limit, args, kwargs), True
            limits.append(limit)
            key = limit.key
            if key is None:
                keys.append(escape_key(self.task_name))
            elif isinstance(key, str):
                if limit.fields:
                    if arguments is None:
                        arguments = self._bind(args, kwargs)
                    keys.append(render(key, arguments, args))
                else:
                    keys.append(fixed_key(key))
            else:
                keys.append(_key_of(key, f"key function of {limit.label}", args, kwargs))
            if isinstance(limit, Concurrency):
                costs.append(1)  # a body holds one slot
                continue
            cost = limit.cost
            if callable(cost) or rated:
                # a declared cost was checked against a declared rate when declared
                if callable(cost):
                    cost = _call_user(cost, f"cost function of {limit.label}", args, kwargs)
                check_cost(cost, f"cost of {limit.label}")
                if cost > limit.fixed_rate.limit:
                    raise InvalidLimit(
                        f"cost {cost} of {self.task_name} is greater than the limit "
                        f"{limit.label}: it could never run"
                    )
            costs.append(cost)
        return Call(tuple(keys), tuple(costs), tuple(limits))

    @cached_property
    def constant(self) -> tuple[tuple[AnyLimit, ...], tuple[int, ...]] | None:
        """The limits and costs of every call, when no rate or cost depends on the call's
        arguments (declared costs were checked against declared rates then)."""
        if self.fixed is not None:
            return self.fixed.limits, self.fixed.costs
        costs: list[int] = []
        for limit in self.limits:
            cost = 1 if isinstance(limit, Concurrency) else limit.cost
            if callable(cost) or (isinstance(limit, Limit) and callable(limit.rate)):
                return None
            costs.append(cost)
        return self.limits, tuple(costs)

    @cached_property
    def fairly(self) -> bool:
        """Has a limit a ``fair_key`` (see :meth:`fair`)?"""
        return any(getattr(one, "fair_key", None) for one in self.limits)

    def fair(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, float] | None:
        """The fair-key value (escaped) and weight of this call, or None when no limit
        has a ``fair_key``.

        Raises:
            InvalidLimit: the template names a missing argument, a fair_key or
                fair_weight function raised, or returned an empty key or a weight that
                is not a positive finite number (that task fails, the others go on).
        """
        limit = next((one for one in self.limits if getattr(one, "fair_key", None)), None)
        if limit is None:
            return None
        key = limit.fair_key
        if isinstance(key, str):
            if limit.fair_fields:
                value = render(key, self._bind(args, kwargs), args)
            else:
                value = fixed_key(key)
        else:
            value = _key_of(key, f"fair_key function of {limit.label}", args, kwargs)
        weight = limit.fair_weight
        if callable(weight):
            what = f"fair_weight function of {limit.label}"
            weight = check_weight(
                _call_user(weight, what, args, kwargs), f"the weight {what} returned"
            )
        return value, weight

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


def _rated(limit: Limit, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Limit:
    """``limit`` with the rate its rate function gives for this call."""
    what = f"rate function of {limit.label}"
    value = _call_user(limit.rate, what, args, kwargs)
    try:
        return limit.with_rate(value)
    except (InvalidRate, InvalidLimit) as exc:
        raise InvalidLimit(f"{what} returned {value!r}: {exc}") from None


def _key_of(function: Any, what: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The escaped key a key function gives for this call.

    Raises:
        InvalidLimit: the function raised, or returned an empty or non-string key.
    """
    value = _call_user(function, what, args, kwargs)
    if not isinstance(value, str) or not value:
        raise InvalidLimit(f"{what} returned {value!r}, expected a non-empty string")
    return escape_key(value)


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
    """Refuse, when the task is built, a key template naming an argument that no call
    of the task can have.

    Raises:
        InvalidLimit: naming the template, the field and the task's signature.
    """
    signature = run_signature(cls)
    if signature is not None:
        check_fields(signature, limits, getattr(cls, "name", None) or cls.__name__)


def check_function_fields(parts: ProxyParts, limits: tuple[Limit, ...]) -> None:
    """:func:`check_key_fields` for a task not built yet, from its function and
    options. When ``bind`` is not known, the function's first parameter stays in: a
    field is refused only if no reading of the signature has it.

    Raises:
        InvalidLimit: naming the template, the field and the function's signature.
    """
    try:
        signature = inspect.signature(parts.function)
    except (TypeError, ValueError):
        return
    if parts.bind:  # the task itself comes first
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    function = parts.function
    check_fields(signature, limits, parts.name or f"{function.__module__}.{function.__name__}")


def check_fields(signature: inspect.Signature, limits: tuple[Limit, ...], name: str) -> None:
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
        for field, template in [
            *((one, limit.key) for one in limit.fields),
            *((one, getattr(limit, "fair_key", None)) for one in getattr(limit, "fair_fields", ())),
        ]:
            if field.isdigit():
                possible = inspect.Parameter.VAR_POSITIONAL in kinds or int(field) < positions
            else:
                possible = field in names or inspect.Parameter.VAR_KEYWORD in kinds
            if not possible:
                raise InvalidLimit(
                    f"key template {template!r} of task {name} names argument {{{field}}}, "
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
            limit.fields
            or callable(limit.key)
            or callable(limit.cost)
            or (isinstance(limit, Limit) and callable(limit.rate))
            for limit in plan.limits
        ):
            plan = dataclasses.replace(plan, fixed=plan.resolve((), {}))
    cls._ratelimit_plan = (spec, plan)
    return plan
