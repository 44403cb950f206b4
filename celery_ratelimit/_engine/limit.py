"""Limit: a rate plus what it applies to (key), what a call costs, and how it is counted."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .calendar import check_window, zone_of
from .concurrency import DEFAULT_LEASE, Concurrency, KeyFunc, WeightFunc
from .exceptions import InvalidLimit
from .rate import Rate
from .validate import _fair_fields, check_cost, check_weight, template_fields

Algorithm = Literal["log", "counter"]
RedisErrorPolicy = Literal["defer", "allow", "raise"]
CostFunc = Callable[..., int]
RateFunc = Callable[..., "str | Rate"]

ALGORITHMS: tuple[str, ...] = ("log", "counter")
REDIS_ERROR_POLICIES: tuple[str, ...] = ("defer", "allow", "raise")


@dataclass(frozen=True, init=False)
class Limit:
    """A shared rate limit: ``rate`` applied to ``key``, each call costing ``cost``.

    Args:
        rate: ``"10/s"``, ``"100/m"``, ``"9500/d"``, ``"50/10s"`` or a :class:`Rate`;
            or, in a task, a callable taking the task's ``(*args, **kwargs)`` and
            returning one (a budget per tier: each rate has its own Redis key).
        key: what shares the budget. A string, which in a task may be a template
            formatted from the call's arguments (``"api:{tenant}"``), or a callable
            taking the task's ``(*args, **kwargs)``. Default: the task name. The part
            before the first ``:`` is the Redis Cluster hash tag: limits checked together
            must share it.
        cost: weight of one call, an int or a callable of ``(*args, **kwargs)``.
        algorithm: ``"log"`` (exact sliding-window log, default) or ``"counter"``
            (sliding-window counter: O(1) memory, approximate).
        on_redis_error: ``"defer"``, ``"allow"`` or ``"raise"``; ``None`` uses the setting.
        name: a label for logs and metrics; defaults to ``key@rate``.
        align: an IANA time zone (``"UTC"``, ``"America/Los_Angeles"``): count in fixed
            windows of the zone's calendar instead of a sliding window, each day from
            midnight to midnight (23 or 25 hours on a DST day), each hour or minute
            from its start; a full window's ``retry_after`` runs to the next one. The
            rate must be per day, hour or minute (``"10000/d"``).
        adapt: follow the upstream's answers (AIMD): each ``UpstreamRateLimited`` (or
            observed ``Retry-After``) halves the key's effective rate, at most once a
            window and never below one call per window; each window without one gives
            back a tenth of the declared rate, up to it. The effective rate lives in
            Redis, shared by every worker, and is read by the same call that decides.
        burst: pace the calls evenly (a sliding limit only): at most ``burst`` cost
            units at once, then no faster than one unit per W/L (GCRA), besides at
            most L in any window; a backlog's reserved slots come one W/L apart. None
            (default): the window alone, so the whole limit may start at once.
        fair_key: who shares the budget fairly when calls must wait (a template of the
            call's arguments such as ``"{tenant}"``, or a callable of them): waiting
            calls take the next slots in proportion to their values' ``fair_weight``,
            not in arrival order (see docs/timing.md, "Fair shares").
        fair_weight: a positive number, or a callable of ``(*args, **kwargs)`` returning
            one (priority classes: ``{"interactive": 9, "batch": 1}.get``).

    Raises:
        InvalidRate: ``rate`` cannot be parsed.
        InvalidLimit: a bad template, algorithm, policy, zone, a cost above the limit,
            an aligned rate that is not per day, hour or minute, a burst that is not a
            positive int at most the limit (or is given with ``align``), a
            ``fair_weight`` not a positive finite number, or a ``fair_key`` on an aligned
            or counter limit.
        TypeError: a cost that is not an int (or is a bool), a key of the wrong type.

    Example::

        Limit("100/m", key="yt:quota:{api_key}", cost=1)
    """

    rate: Rate | RateFunc
    key: str | KeyFunc | None
    cost: int | CostFunc
    algorithm: Algorithm
    on_redis_error: RedisErrorPolicy | None
    name: str | None
    align: str | None
    adapt: bool
    burst: int | None
    fair_key: str | KeyFunc | None
    fair_weight: float | WeightFunc
    fields: tuple[str, ...] = field(repr=False, compare=False)
    fair_fields: tuple[str, ...] = field(repr=False, compare=False)

    def __init__(
        self,
        rate: str | Rate | RateFunc,
        *,
        key: str | KeyFunc | None = None,
        cost: int | CostFunc = 1,
        algorithm: Algorithm = "log",
        on_redis_error: RedisErrorPolicy | None = None,
        name: str | None = None,
        align: str | None = None,
        adapt: bool = False,
        burst: int | None = None,
        fair_key: str | KeyFunc | None = None,
        fair_weight: float | WeightFunc = 1,
    ) -> None:
        if not isinstance(adapt, bool):
            raise TypeError(f"Limit adapt must be True or False, got {adapt!r}")
        set_ = object.__setattr__
        set_(self, "rate", rate if callable(rate) else Rate.parse(rate))
        set_(self, "align", align)
        set_(self, "adapt", adapt)
        set_(self, "burst", burst)
        set_(self, "key", key)
        set_(self, "cost", cost)
        set_(self, "algorithm", algorithm)
        set_(self, "on_redis_error", on_redis_error)
        set_(self, "name", name)
        set_(self, "fields", ())
        set_(self, "fair_key", fair_key)
        set_(
            self, "fair_weight", fair_weight if callable(fair_weight) else check_weight(fair_weight)
        )
        set_(self, "fair_fields", ())
        self._validate()

    def __hash__(self) -> int:
        # computed once (see _validate): a limiter looks its limits up in its caches on
        # every decision, and hashing the fields (the Rate's among them) each time would
        # cost more than the lookup
        value = self.__dict__.get("_hash")
        return hash(self._identity()) if value is None else value

    def __getstate__(self) -> dict[str, object]:
        # a hash is only valid in the process that computed it (string hashing is
        # seeded per process): never pickle it
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def _identity(self) -> tuple[object, ...]:
        """The fields that make two limits equal (what ``__eq__`` compares)."""
        return (
            self.rate,
            self.key,
            self.cost,
            self.algorithm,
            self.on_redis_error,
            self.name,
            self.align,
            self.adapt,
            self.burst,
            self.fair_key,
            self.fair_weight,
        )

    @property
    def kind(self) -> str:
        """How the limit counts: ``"log"``, ``"counter"``, or ``"cal"`` (aligned)."""
        return "cal" if self.align is not None else self.algorithm

    def _validate(self) -> None:
        self._check_key()
        if not callable(self.cost):
            check_cost(self.cost, "Limit cost")
            if isinstance(self.rate, Rate) and self.cost > self.rate.limit:
                raise InvalidLimit(
                    f"Limit cost {self.cost} is greater than the limit of {self.rate}: "
                    "such a call could never run"
                )
        self._check_options()
        if self.align is not None:
            zone_of(self.align)
            if isinstance(self.rate, Rate):
                check_window(self.rate.window_us, self.rate)
        if self.burst is not None:
            self._check_burst()
        if self.fair_key is not None:
            object.__setattr__(self, "fair_fields", _fair_fields(self.fair_key, "Limit"))
            if self.align is not None or self.algorithm != "log":
                raise InvalidLimit(
                    f"Limit fair_key {self.fair_key!r} needs reserved slots: the log "
                    "algorithm, not an aligned or counter limit"
                )
        with contextlib.suppress(TypeError):  # an unhashable callable key or cost:
            self.__dict__["_hash"] = hash(self._identity())  # hashing it raises, as ever

    def _check_key(self) -> None:
        if self.key is not None and not isinstance(self.key, str) and not callable(self.key):
            raise TypeError(f"Limit key must be a string, a callable or None, got {self.key!r}")
        if isinstance(self.key, str):
            if not self.key:
                raise InvalidLimit("Limit key must not be empty")
            object.__setattr__(self, "fields", template_fields(self.key))

    def _check_options(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise InvalidLimit(
                f"unknown algorithm {self.algorithm!r}: expected one of {', '.join(ALGORITHMS)}"
            )
        if self.on_redis_error is not None and self.on_redis_error not in REDIS_ERROR_POLICIES:
            raise InvalidLimit(
                f"unknown on_redis_error {self.on_redis_error!r}: expected one of "
                f"{', '.join(REDIS_ERROR_POLICIES)}"
            )
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise InvalidLimit(f"Limit name must be a non-empty string, got {self.name!r}")

    def _check_burst(self) -> None:
        burst = self.burst
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise InvalidLimit(f"Limit burst must be a positive int or None, got {burst!r}")
        if isinstance(self.rate, Rate) and burst > self.rate.limit:
            raise InvalidLimit(
                f"Limit burst {burst} is greater than the limit of {self.rate}: "
                "a window never lets more than its limit start at once"
            )
        if self.align is not None:
            raise InvalidLimit(
                f"Limit burst={burst} with align={self.align!r}: a calendar quota is not "
                "paced; give the burst to a sliding Limit stacked with it"
            )

    @property
    def label(self) -> str:
        """``name`` if given, else ``key@rate`` (for logs and metrics)."""
        if self.name:
            return self.name
        key = self.key if isinstance(self.key, str) else getattr(self.key, "__name__", "task")
        rate = self.rate if isinstance(self.rate, Rate) else getattr(self.rate, "__name__", "rate")
        zone = f" ({self.align})" if self.align else ""
        return f"{key or 'task'}@{rate}{zone}"

    @property
    def fixed_rate(self) -> Rate:
        """The rate, when it does not depend on a call's arguments.

        Raises:
            InvalidLimit: the rate is a callable (a task call resolves it: ``with_rate``).
        """
        if isinstance(self.rate, Rate):
            return self.rate
        raise InvalidLimit(
            f"the rate of {self.label} is a function of a task call's arguments: "
            "it can only be used by a task"
        )

    def with_rate(self, rate: str | Rate) -> Limit:
        """This limit with ``rate`` in place of its rate function (for one call).

        Raises:
            InvalidRate: ``rate`` cannot be parsed.
            InvalidLimit: the limit's own cost is above it.
        """
        return Limit(
            rate,
            key=self.key,
            cost=self.cost,
            algorithm=self.algorithm,
            on_redis_error=self.on_redis_error,
            name=self.name,
            align=self.align,
            adapt=self.adapt,
            burst=self.burst,
            fair_key=self.fair_key,
            fair_weight=self.fair_weight,
        )


AnyLimit = Limit | Concurrency
LimitSpec = str | Rate | Limit | Concurrency | Iterable[str | Rate | Limit | Concurrency]
#: A call's key: a string, or escaped keys, one per limit (as the Celery layer resolves them).
KeySpec = str | Sequence[str]
#: A call's cost: one weight for every limit, or one per limit.
CostSpec = int | Sequence[int]


_PARSED: dict[str, tuple[Limit, ...]] = {}
#: Tuples of limits, normalized (the same limits give the same tuple).
_NORMALIZED: dict[tuple[object, ...], tuple[Any, ...]] = {}


def to_limits(spec: object, what: str = "limits") -> tuple[Any, ...]:
    """Normalize a rate string, a :class:`Rate`, a :class:`Limit`, a
    :class:`Concurrency` or a list of them: sliding rate limits first, then aligned
    ones, then concurrency limits (each in the order given).

    Raises:
        InvalidLimit: an empty list, or rate limits of different algorithms in one list.
        TypeError: an item that is none of the above.
    """
    if isinstance(spec, str):
        # a rate string, as in acquire("k", "100/m"): parsed once (a Limit is immutable)
        parsed = _PARSED.get(spec)
        if parsed is None:
            parsed = (Limit(spec),)
            if len(_PARSED) >= 1024:
                _PARSED.clear()
            _PARSED[spec] = parsed
        return parsed
    if type(spec) is tuple:
        # the limits a task or a caller gives on every call: normalized once
        with contextlib.suppress(KeyError, TypeError):  # TypeError: an unhashable item
            return _NORMALIZED[spec]
    limits: list[Limit] = []
    slots: list[Concurrency] = []
    for item in _items(spec, what):
        if isinstance(item, (str, Rate)):
            item = Limit(item)
        if isinstance(item, Concurrency):
            slots.append(item)
        elif isinstance(item, Limit):
            limits.append(item)
        else:
            raise TypeError(
                f"{what} must contain rate strings, Limits or Concurrency, got {item!r}"
            )
    normalized = _ordered(limits, slots, what)
    if type(spec) is tuple:
        with contextlib.suppress(TypeError):
            if len(_NORMALIZED) >= 1024:
                _NORMALIZED.clear()
            _NORMALIZED[spec] = normalized
    return normalized


def _items(spec: object, what: str) -> Sequence[object]:
    if isinstance(spec, Rate):
        return [Limit(spec)]
    if isinstance(spec, (Limit, Concurrency)):
        return [spec]
    if isinstance(spec, Iterable) and not isinstance(spec, (bytes, Mapping)):
        return list(spec)
    raise TypeError(f"{what} must be a rate string, a Limit or a list of Limits, got {spec!r}")


def _ordered(limits: list[Limit], slots: list[Concurrency], what: str) -> tuple[Any, ...]:
    """Sliding rate limits, aligned ones, then concurrency limits, checked together."""
    if not limits and not slots:
        raise InvalidLimit(f"{what} must not be empty: give at least one rate or Limit")
    every: list[Limit | Concurrency] = [*limits, *slots]
    fair = [limit for limit in every if limit.fair_key is not None]
    if fair and len(every) > 1:
        raise InvalidLimit(
            f"{what}: {fair[0].label} has a fair_key, and fair shares are kept for a call "
            "of one Limit or Concurrency: it cannot be stacked with other limits"
        )
    aligned = [limit for limit in limits if limit.align is not None]
    sliding = [limit for limit in limits if limit.align is None]
    algorithms = {limit.algorithm for limit in sliding}
    if len(algorithms) > 1:
        raise InvalidLimit(
            f"{what} mixes algorithms {sorted(algorithms)}: limits checked together "
            "must all be 'log' or all be 'counter'"
        )
    return (*sliding, *aligned, *slots)


def rate_algorithm(limits: tuple[Any, ...]) -> str:
    """The script a call of ``limits`` runs: its sliding rate limits' algorithm, or
    ``"concurrency"`` when it has none (only aligned and concurrency limits)."""
    first = limits[0]
    if isinstance(first, Concurrency) or first.align is not None:
        return "concurrency"
    return str(first.algorithm)


def describe(limits: Iterable[Any]) -> str:
    """A short text for logs: ``"yt:quota@9500/d + search@100/m"``."""
    return " + ".join(limit.label for limit in limits)


__all__ = [
    "DEFAULT_LEASE",
    "AnyLimit",
    "Concurrency",
    "CostFunc",
    "CostSpec",
    "KeyFunc",
    "KeySpec",
    "Limit",
    "LimitSpec",
    "RateFunc",
    "WeightFunc",
    "check_cost",
    "check_weight",
    "describe",
    "rate_algorithm",
    "template_fields",
    "to_limits",
]
