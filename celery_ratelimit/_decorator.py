"""ratelimit(...): give a task declared with plain ``@app.task`` a shared rate limit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from celery import Task, _state
from celery.local import PromiseProxy, Proxy

from ._limit import CostFunc, KeyFunc, Limit, LimitSpec, to_limits
from ._settings import setting
from ._task import wrap_before_start

T = TypeVar("T")

_OPTIONS = ("max_countdown", "max_deferrals", "reserve", "on_redis_error")


def ratelimit(
    rate: LimitSpec,
    *,
    key: str | KeyFunc | None = None,
    cost: int | CostFunc = 1,
    algorithm: str = "log",
    **options: Any,
) -> Callable[[T], T]:
    """Decorate a Celery task (placed above ``@app.task`` or ``@shared_task``).

    Args:
        rate: a rate string (then ``key``, ``cost`` and ``algorithm`` build the
            :class:`Limit`), a :class:`Limit`, or a list of Limits.
        key, cost, algorithm: as for :class:`Limit`, when ``rate`` is a string.
        max_countdown, max_deferrals, reserve, on_redis_error: this task's
            ``ratelimit_*`` options (see the settings in README).

    The limits are validated here, when the module is imported.

    Raises:
        InvalidRate, InvalidLimit, TypeError: bad rate, key, cost or option.

    Example::

        @ratelimit("10/s", key="search")
        @app.task
        def search(q): ...
    """
    if isinstance(rate, str):
        limits = to_limits(Limit(rate, key=key, cost=cost, algorithm=algorithm))  # type: ignore[arg-type]
    else:
        if key is not None or cost != 1 or algorithm != "log":
            raise TypeError("key, cost and algorithm apply to a rate string; put them in the Limit")
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
        if isinstance(task, PromiseProxy) and not task.__evaluated__():
            # @app.task before the app is finalized: attach once Celery builds the task.
            task.__then__(lambda: _attach(task._get_current_object(), attributes))
        elif isinstance(task, Proxy) and _shared_function(task) is not None:
            # @shared_task: every app builds its own copy when it is finalized.
            function = _shared_function(task)
            _SHARED[function] = attributes
            for app in _state._get_active_apps():
                if app.finalized:
                    _attach_shared(app)
        elif isinstance(task, (Task, Proxy)):
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


def _shared_function(proxy: Any) -> Any:
    """The function behind a ``shared_task`` proxy (held in its constructor's closure)."""
    try:
        constructor = object.__getattribute__(proxy, "_Proxy__local")
        cells = dict(
            zip(constructor.__code__.co_freevars, constructor.__closure__ or (), strict=False)
        )
        return cells["fun"].cell_contents if "fun" in cells else None
    except (AttributeError, TypeError, ValueError):
        return None


def _attach_shared(sender: Any, **_: Any) -> None:
    for task in list(sender._tasks.values()):
        attributes = _SHARED.get(getattr(task, "__wrapped__", None))
        if attributes is not None:
            _attach(task, attributes)


def _watch_app(app: Any) -> None:
    app.on_after_finalize.connect(_attach_shared, weak=False)


_state.connect_on_app_finalize(_watch_app)


class _NoApp:
    class conf:
        @staticmethod
        def get(name: str, default: Any = None) -> Any:
            return default


_NO_APP = _NoApp()
