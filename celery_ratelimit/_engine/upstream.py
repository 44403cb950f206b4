"""UpstreamRateLimited: a task body's way to say "the API answered 429", and how long
that means, read from a number, a ``Retry-After`` header value or a datetime."""

from __future__ import annotations

import datetime
import email.utils
import time
from typing import Any

from .exceptions import InvalidLimit

#: How long a 429 that gives no ``Retry-After`` pauses its keys (seconds).
DEFAULT_PAUSE = 1.0


def seconds_from(value: Any) -> float:
    """Seconds from now until ``value``: a number of seconds, a ``Retry-After`` header
    value (``"120"`` or an HTTP-date such as ``"Wed, 21 Oct 2026 07:28:00 GMT"``), a
    ``timedelta`` or a datetime (naive: UTC). Past instants give 0.0.

    Raises:
        InvalidLimit: anything else, naming it.
    """
    if isinstance(value, bool):
        raise InvalidLimit(f"not a retry-after: {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, datetime.datetime):
        when = value if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)
        seconds = when.timestamp() - time.time()
    elif isinstance(value, (str, bytes)):
        text = (value.decode("latin-1") if isinstance(value, bytes) else value).strip()
        try:
            seconds = float(int(text))
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError):
                raise InvalidLimit(
                    f"not a Retry-After value (seconds or an HTTP-date): {value!r}"
                ) from None
            return seconds_from(when)
    else:
        raise InvalidLimit(
            f"retry_after must be seconds, a Retry-After value or a datetime, got {value!r}"
        )
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise InvalidLimit(f"not a retry-after: {value!r}")
    return max(seconds, 0.0)


class UpstreamRateLimited(Exception):
    """Raise it from a task body when the upstream answered 429 (rate limited).

    Every worker then grants nothing on the task's limit keys (or ``key``) until the
    pause ends, and the task runs again after it on a reserved slot, its retries
    untouched.

    Args:
        retry_after: seconds, a ``Retry-After`` header value (seconds or an HTTP-date)
            or a datetime; None: :data:`DEFAULT_PAUSE`.
        key: the key to pause instead of the task's own (a rendered key, not a template).

    Raises:
        InvalidLimit: a ``retry_after`` that is none of those (at once, in the body).

    Example::

        if response.status_code == 429:
            raise UpstreamRateLimited(response.headers.get("Retry-After"))
    """

    def __init__(self, retry_after: Any = None, *, key: str | None = None) -> None:
        self.seconds = DEFAULT_PAUSE if retry_after is None else seconds_from(retry_after)
        if key is not None and (not isinstance(key, str) or not key):
            raise InvalidLimit(f"UpstreamRateLimited key must be a non-empty string, got {key!r}")
        self.retry_after = retry_after
        self.key = key
        super().__init__(f"upstream rate limited: retry after {self.seconds:g}s")


__all__ = ["DEFAULT_PAUSE", "UpstreamRateLimited", "seconds_from"]
