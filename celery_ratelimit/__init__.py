"""celery-ratelimit: one rate limit shared by every Celery worker node, kept in Redis.

Public API::

    from celery_ratelimit import Limit, Limiter, Decision, RateLimitedTask, ratelimit, install
    from celery_ratelimit import RateLimitError, RateLimitExceeded
"""

from __future__ import annotations

from ._decision import Decision
from ._decorator import ratelimit
from ._exceptions import (
    InvalidLimit,
    InvalidRate,
    LimiterMisconfigured,
    LimiterUnavailable,
    RateLimitError,
    RateLimitExceeded,
)
from ._install import install
from ._limit import Limit
from ._limiter import Limiter
from ._rate import Rate
from ._task import RateLimitedTask

__all__ = [
    "Decision",
    "InvalidLimit",
    "InvalidRate",
    "Limit",
    "Limiter",
    "LimiterMisconfigured",
    "LimiterUnavailable",
    "Rate",
    "RateLimitError",
    "RateLimitExceeded",
    "RateLimitedTask",
    "install",
    "ratelimit",
]
__version__ = "0.1.0"
