"""Concurrency: at most n bodies of a key running at once, held for a lease."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .exceptions import InvalidLimit
from .validate import _fair_fields, check_weight, template_fields

KeyFunc = Callable[..., object]
WeightFunc = Callable[..., float]

#: A concurrency slot's lease when neither the limit nor the task gives one (seconds).
DEFAULT_LEASE = 300.0


@dataclass(frozen=True, init=False)
class Concurrency:
    """At most ``n`` task bodies running at once per key, across every worker.

    Accepted wherever a :class:`Limit` is, and checked with the rate limits in the same
    script call, all or nothing. A body holds its slot from its start to its end; a
    slot whose holder was lost (a worker killed) comes back when its lease runs out.

    Args:
        n: how many at once (a positive int).
        key: what shares the slots, as a Limit's key (a template such as
            ``"erp:{tenant}"``, or a callable); default: the task name.
        lease: seconds a slot is held without news from its holder (renewed while the
            body runs). Default: the task's ``time_limit``, else the setting
            ``ratelimit_concurrency_lease`` (300 s); outside Celery 300 s.
        name: a label for logs and metrics; defaults to ``key@n at once``.
        fair_key, fair_weight: as a :class:`Limit`'s: turns go to the waiting values
            of ``fair_key`` in proportion to their weights, not in arrival order.

    Raises:
        InvalidLimit: ``n`` or ``lease`` not positive, a bad template, name or weight.
        TypeError: ``n`` not an int, a key of the wrong type.

    Example::

        Concurrency(1, key="erp:{tenant}")
    """

    n: int
    key: str | KeyFunc | None
    lease: float | None
    name: str | None
    fair_key: str | KeyFunc | None
    fair_weight: float | WeightFunc
    fields: tuple[str, ...] = field(repr=False, compare=False)
    fair_fields: tuple[str, ...] = field(repr=False, compare=False)
    #: what the rest of the library reads off any limit
    cost = 1
    algorithm = kind = "conc"
    on_redis_error = None
    adapt = False

    def __init__(
        self,
        n: int,
        key: str | KeyFunc | None = None,
        *,
        lease: float | None = None,
        name: str | None = None,
        adapt: bool = False,
        fair_key: str | KeyFunc | None = None,
        fair_weight: float | WeightFunc = 1,
    ) -> None:
        if adapt is not False:
            raise InvalidLimit(
                f"Concurrency({n!r}, key={key!r}) cannot adapt: adapt=True follows an "
                "upstream's rate, and a Concurrency counts running bodies, not a rate "
                "(give it to the Limit stacked with it)"
            )
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"Concurrency n must be a positive int, got {n!r}")
        if n < 1:
            raise InvalidLimit(f"Concurrency n must be a positive int, got {n!r}")
        if lease is not None and (
            isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease > 0
        ):
            raise InvalidLimit(
                f"Concurrency lease must be a positive number of seconds, got {lease!r}"
            )
        if key is not None and not isinstance(key, str) and not callable(key):
            raise TypeError(f"Concurrency key must be a string, a callable or None, got {key!r}")
        if key == "":
            raise InvalidLimit("Concurrency key must not be empty")
        if name is not None and (not isinstance(name, str) or not name):
            raise InvalidLimit(f"Concurrency name must be a non-empty string, got {name!r}")
        set_ = object.__setattr__
        set_(self, "n", n)
        set_(self, "key", key)
        set_(self, "lease", None if lease is None else float(lease))
        set_(self, "name", name)
        set_(self, "fields", template_fields(key) if isinstance(key, str) else ())
        set_(self, "fair_key", fair_key)
        set_(
            self, "fair_weight", fair_weight if callable(fair_weight) else check_weight(fair_weight)
        )
        set_(self, "fair_fields", _fair_fields(fair_key, f"Concurrency({n!r}, key={key!r})"))

    @property
    def label(self) -> str:
        """``name`` if given, else ``key@n at once`` (for logs and metrics)."""
        if self.name:
            return self.name
        key = self.key if isinstance(self.key, str) else getattr(self.key, "__name__", "task")
        return f"{key or 'task'}@{self.n} at once"


__all__ = ["DEFAULT_LEASE", "Concurrency"]
