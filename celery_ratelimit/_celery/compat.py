"""Every use of a private part of Celery, each in one function with a public fallback.

Celery offers no public way to do two things this library does better with its
internals. Each is detected the first time it is needed, and when it is missing (a
release moved it) or ``CELERY_RATELIMIT_PUBLIC_ONLY=1`` is set in the environment, the
public path below it is taken instead:

- **Which function a ``@shared_task`` proxy stands for** (read from the proxy's
  constructor closure), so that ``@ratelimit`` above ``@shared_task`` attaches to every
  app's copy of the task the moment that app is finalized (``celery._state``'s
  finalize callbacks). Fallback: the decorator keeps the proxy and attaches when a
  worker starts (the public ``import_modules`` and ``worker_init`` signals) and before
  the ``ratelimit`` commands look at a task, by evaluating the proxy in the current app.
- **Which function and options a task proxy stands for** (``@app.task`` before its
  app is finalized, ``@shared_task``), so that ``@ratelimit`` checks its key templates
  against the function's signature when it decorates. Fallback: they are checked when
  Celery builds the task (its app finalized: a worker's start, a first ``.delay()``).
- **A received task's ETA** (``Request._eta``), moved from Redis time to the worker's
  clock (see ``clock``). Fallback: the ETA is left as the sender wrote it: exact while
  the workers' clocks agree, early or late by their disagreement otherwise (an early
  copy is still held back by its reservation's confirmation).

Nothing of redis-py's private is used (see ``client``).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any, NamedTuple

#: Force every public fallback (for the tests, or when a new Celery breaks a private path).
PUBLIC_ONLY = os.environ.get("CELERY_RATELIMIT_PUBLIC_ONLY", "") not in ("", "0")


def shared_task_function(proxy: Any) -> Callable[..., Any] | None:
    """The function behind a ``@shared_task`` proxy, or None when it cannot be read."""
    parts = task_proxy_parts(proxy)
    return parts.function if parts is not None else None


class ProxyParts(NamedTuple):
    """What a task proxy stands for: its function, its ``name`` option (None: the
    default name), and its ``bind`` option (None: not known, for ``@shared_task``)."""

    function: Callable[..., Any]
    name: str | None
    bind: bool | None


def task_proxy_parts(proxy: Any) -> ProxyParts | None:
    """The function and options behind a task not built yet: the proxy ``@app.task``
    returns before its app is finalized, or a ``@shared_task`` proxy. None when they
    cannot be read."""
    if PUBLIC_ONLY:
        return None
    try:
        try:
            args = object.__getattribute__(proxy, "_Proxy__args")
        except AttributeError:
            args = ()
        if args:  # @app.task: PromiseProxy(app._task_from_fun, (fun,), options)
            options = object.__getattribute__(proxy, "_Proxy__kwargs")
            function, name, bind = args[0], options.get("name"), bool(options.get("bind"))
        else:  # @shared_task: Proxy(task_by_cons), a closure of fun and name
            constructor = object.__getattribute__(proxy, "_Proxy__local")
            cells = dict(
                zip(constructor.__code__.co_freevars, constructor.__closure__ or (), strict=False)
            )
            function = cells["fun"].cell_contents
            name = cells["name"].cell_contents if "name" in cells else None
            bind = None
    except (AttributeError, TypeError, ValueError, KeyError, IndexError):
        return None
    if not callable(function):
        return None
    return ProxyParts(function, name if isinstance(name, str) else None, bind)


def on_every_app_finalize(callback: Callable[[Any], None]) -> bool:
    """Call ``callback(app)`` whenever a Celery app is finalized, from now on. False
    when Celery offers no such hook."""
    if PUBLIC_ONLY:
        return False
    try:
        from celery import _state

        connect = _state.connect_on_app_finalize
    except (ImportError, AttributeError):
        return False
    connect(callback)
    return True


def finalized_apps() -> list[Any] | None:
    """Every Celery app of this process that is finalized, or None when unknown."""
    if PUBLIC_ONLY:
        return None
    try:
        from celery import _state

        active = _state._get_active_apps
    except (ImportError, AttributeError):
        return None
    return [app for app in list(active()) if app.finalized]


def set_received_eta(request: Any, eta: datetime.datetime) -> bool:
    """Give a received task (``celery.worker.request.Request``) a new ETA before the
    worker schedules it. False when that is not possible (the ETA is left as it is)."""
    if PUBLIC_ONLY:
        return False
    if not isinstance(getattr(type(request), "eta", None), property):
        return False
    if not isinstance(getattr(request, "_eta", None), datetime.datetime):
        return False
    request._eta = eta
    return request.eta is eta
