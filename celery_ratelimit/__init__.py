"""celery-ratelimit: one rate limit shared by every Celery worker node, kept in Redis.

Public API::

    from celery_ratelimit import Limit, Concurrency, Limiter, AsyncLimiter, Decision
    from celery_ratelimit import RateLimitedTask, ratelimit, install
    from celery_ratelimit import UpstreamRateLimited, RateLimitError, RateLimitExceeded
    from celery_ratelimit import settle, observe
"""

from __future__ import annotations

from . import _startup  # noqa: F401  (connects the limiter's check at worker_ready)
from ._async import AsyncLimiter
from ._decision import Decision
from ._decorator import ratelimit
from ._exceptions import (
    InvalidLimit,
    InvalidRate,
    InvalidRedisURL,
    LimiterMisconfigured,
    LimiterUnavailable,
    RateLimitError,
    RateLimitExceeded,
)
from ._install import install
from ._limit import Concurrency, Limit
from ._limiter import Limiter
from ._observe import observe
from ._rate import Rate
from ._settle import settle
from ._task import RateLimitedTask
from ._upstream import UpstreamRateLimited

__all__ = [
    "AsyncLimiter",
    "Concurrency",
    "Decision",
    "InvalidLimit",
    "InvalidRate",
    "InvalidRedisURL",
    "Limit",
    "Limiter",
    "LimiterMisconfigured",
    "LimiterUnavailable",
    "Rate",
    "RateLimitError",
    "RateLimitExceeded",
    "RateLimitedTask",
    "UpstreamRateLimited",
    "install",
    "observe",
    "ratelimit",
    "settle",
]
__version__ = "0.1.0"
