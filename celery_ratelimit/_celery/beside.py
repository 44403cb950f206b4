"""Values kept beside a task's request, never in it.

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

from __future__ import annotations

import secrets
import weakref
from typing import Any

from celery.app.task import Context

#: Each request a value was set on, by its handle (gone with the request).
_requests: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
#: The values kept for a request, by name (gone with the request).
_values: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


class Beside:
    """``request.<name>``: the value kept beside the request (None if none)."""

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
