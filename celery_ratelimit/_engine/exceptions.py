"""The exception tree of celery-ratelimit.

::

    RateLimitError                      root: catch this to catch everything below
    ├── InvalidRate(ValueError)         a rate string or Rate that cannot be a rate
    ├── InvalidLimit(ValueError)        a Limit, cost, key template or setting that is wrong
    ├── RateLimitExceeded               a task gave up after ``ratelimit_max_deferrals``
    ├── LimiterUnavailable              Redis could not be reached, for now (a failover, a restart)
    └── LimiterMisconfigured            Redis refuses the limiter until its configuration changes
        └── InvalidRedisURL(ValueError) a limiter URL that names no Redis at all

``InvalidRate``, ``InvalidLimit`` and ``InvalidRedisURL`` are also ``ValueError`` so that
plain ``except ValueError`` keeps working; type mistakes (a float cost, a bool cost) raise
``TypeError``.
Errors from redis-py are translated where they enter, in ``Limiter``, and chained
(``raise LimiterUnavailable(...) from exc``).
"""

from __future__ import annotations


class RateLimitError(Exception):
    """Base class of every error raised by celery-ratelimit."""


class InvalidRate(RateLimitError, ValueError):
    """A rate such as ``"10/s"`` could not be parsed or is out of range."""


class InvalidLimit(RateLimitError, ValueError):
    """A limit, cost, key template or setting is invalid."""


class RateLimitExceeded(RateLimitError):
    """A task was deferred more times than ``ratelimit_max_deferrals`` allows.

    Raised inside the worker, so the task ends in ``FAILURE`` with this error.
    """


class LimiterUnavailable(RateLimitError):
    """Redis could not be reached, timed out, or answered with an error that passes
    (``LOADING``, ``BUSY``, ``READONLY`` around a failover, ...).

    In a worker, the task's ``ratelimit_on_redis_error`` policy decides what happens.
    """


class LimiterMisconfigured(RateLimitError):
    """Redis answered, and will refuse the limiter until its configuration changes: a
    wrong password, a missing ACL permission, a server older than 6.2, a key of another
    type under the prefix, or no Redis server at that address. The message names the
    cause and the fix.

    In a worker, the task fails at once (whatever ``ratelimit_on_redis_error`` says).
    """


class InvalidRedisURL(LimiterMisconfigured, ValueError):
    """A limiter's Redis URL that names no server this library can connect to: not a
    URL, an unknown scheme, a malformed host, port or database (the message names it,
    its password hidden). Raised before anything is sent, where the URL is given
    (``Limiter.from_url``, ``ratelimit_redis_url``, ``--url``).
    """
