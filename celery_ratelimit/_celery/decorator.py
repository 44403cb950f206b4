"""ratelimit(...): give a task declared with plain ``@app.task`` a shared rate limit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from celery import Task, current_app, signals
from celery.local import PromiseProxy, Proxy

from .._engine.limit import (
    Concurrency,
    CostFunc,
    KeyFunc,
    Limit,
    LimitSpec,
    RateFunc,
    WeightFunc,
    to_limits,
)
from . import compat
from .plan import check_function_fields
from .settings import TASK_OPTIONS, setting
from .task import wrap_before_start

T = TypeVar("T")

_OPTIONS = tuple(name.removeprefix("ratelimit_") for name in TASK_OPTIONS)


def ratelimit(
    rate: LimitSpec | RateFunc,
    *,
    key: str | KeyFunc | None = None,
    cost: int | CostFunc = 1,
    algorithm: str = "log",
    align: str | None = None,
    adapt: bool = False,
    burst: int | None = None,
    fair_key: str | KeyFunc | None = None,
    fair_weight: float | WeightFunc = 1,
    **options: Any,
) -> Callable[[T], T]:
    """Decorate a Celery task (placed above ``@app.task`` or ``@shared_task``).

    Args:
        rate: a rate string or a rate function (then ``key``, ``cost``,
            ``algorithm``, ``align``, ``adapt``, ``burst``, ``fair_key`` and
            ``fair_weight`` build the :class:`Limit`), a :class:`Limit`, a
            :class:`Concurrency`, or a list of them (checked all or nothing).
        key, cost, algorithm, align, adapt, burst, fair_key, fair_weight: as for
            :class:`Limit`, when ``rate`` is a string or function.
        on_redis_error, max_countdown, max_deferrals, reserve, guard,
            redis_error_countdown, concurrency_lease: this task's ``ratelimit_*``
            options (see the settings in README).

    The limits are validated here, when the module is imported, and so are the key
    templates, against the task function's signature.

    Raises:
        InvalidRate, InvalidLimit, TypeError: bad rate, key, cost or option.

    Example::

        @ratelimit("10/s", key="search")
        @app.task
        def search(q): ...
    """
    if isinstance(rate, str) or (callable(rate) and not isinstance(rate, (Limit, Concurrency))):
        limits = to_limits(
            Limit(
                rate,
                key=key,
                cost=cost,
                algorithm=algorithm,  # type: ignore[arg-type]
                align=align,
                adapt=adapt,
                burst=burst,
                fair_key=fair_key,
                fair_weight=fair_weight,
            )
        )
    else:
        given = (
            key,
            cost != 1,
            algorithm != "log",
            align,
            adapt,
            burst,
            fair_key,
            fair_weight != 1,
        )
        if any(value not in (None, False) for value in given):
            raise TypeError(
                "key, cost, algorithm, align, adapt, burst, fair_key and fair_weight apply to "
                "a rate string; put them in the Limit"
            )
        limits = to_limits(rate)
    attributes: dict[str, Any] = {"ratelimit": limits}
    for name, value in options.items():
        if name not in _OPTIONS:
            raise TypeError(
                f"ratelimit() got an unexpected option {name!r}; "
                f"expected one of {', '.join(_OPTIONS)}"
            )
        full = f"ratelimit_{name}"
        setting(full, _NO_APP, type("Options", (), {full: value})())  # validates now
        attributes[full] = value

    def decorate(task: T) -> T:
        # type(), not isinstance(): a proxy answers isinstance() for what it stands for,
        # which would build a task (or fail) before its app is ready
        kind = type(task)
        if issubclass(kind, Proxy):
            parts = compat.task_proxy_parts(task)
            if parts is not None:  # else checked when Celery builds the task
                check_function_fields(parts, limits)
        if issubclass(kind, PromiseProxy):
            # @app.task: attach once Celery builds the task (now, if it has)
            proxy: Any = task
            proxy.__then__(lambda: _attach(proxy.__maybe_evaluate__(), attributes))
        elif issubclass(kind, Proxy):
            # @shared_task: every app builds its own copy when it is finalized.
            _attach_shared_proxy(task, attributes)
        elif issubclass(kind, Task):
            _attach(task, attributes)
        else:
            raise TypeError(
                f"@ratelimit must be placed above @app.task or @shared_task, got {task!r}"
            )
        return task

    return decorate


def _attach(task: Any, attributes: dict[str, Any]) -> None:
    cls = type(task)
    for name, value in attributes.items():
        setattr(cls, name, value)
    wrap_before_start(cls)


#: Functions decorated with @ratelimit above @shared_task, and their attributes.
_SHARED: dict[Any, dict[str, Any]] = {}
#: ``@shared_task`` proxies whose function could not be read (see ``compat``), and their
#: attributes: attached when a worker starts or the ``ratelimit`` commands load the tasks.
_PENDING: list[tuple[Any, dict[str, Any]]] = []


def _attach_shared_proxy(proxy: Any, attributes: dict[str, Any]) -> None:
    function = compat.shared_task_function(proxy) if _HOOKED else None
    apps = compat.finalized_apps() if function is not None else None
    if function is None or apps is None:
        _PENDING.append((proxy, attributes))
        if current_app.finalized:
            attach_pending(current_app)
        return
    _SHARED[function] = attributes
    for app in apps:
        _attach_shared(app)


def _watch_app(app: Any) -> None:
    app.on_after_finalize.connect(_attach_shared, weak=False)


def _attach_shared(sender: Any, **_: Any) -> None:
    for task in list(sender.tasks.values()):
        attributes = _SHARED.get(getattr(task, "__wrapped__", None))
        if attributes is not None:
            _attach(task, attributes)


def attach_pending(app: Any) -> None:
    """Attach the kept ``@shared_task`` proxies' options to ``app``'s copies of them
    (the public fallback: each proxy is evaluated in the current app for its name)."""
    for proxy, attributes in list(_PENDING):
        try:
            name = proxy.name
        except Exception:  # no app can build it yet; the next start tries again
            continue
        task = app.tasks.get(name)
        if task is not None:
            _attach(task, attributes)


def _attach_pending_on_import(sender: Any = None, **_: Any) -> None:
    if _PENDING and sender is not None:
        attach_pending(sender)


def _attach_pending_on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if _PENDING and app is not None:
        attach_pending(app)


#: Whether every app's finalization reaches ``_watch_app`` (Celery's private hook).
_HOOKED = compat.on_every_app_finalize(_watch_app)
signals.import_modules.connect(_attach_pending_on_import, weak=False)
signals.worker_init.connect(_attach_pending_on_worker_init, weak=False)


class _NoApp:
    class conf:
        @staticmethod
        def get(name: str, default: Any = None) -> Any:
            return default


_NO_APP = _NoApp()
