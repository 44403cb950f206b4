"""celery-ratelimit: one rate limit shared by every Celery worker node, kept in Redis.

Public API::

    from celery_ratelimit import Limit, Concurrency, Limiter, AsyncLimiter, Decision
    from celery_ratelimit import RateLimitedTask, ratelimit, install
    from celery_ratelimit import UpstreamRateLimited, RateLimitError, RateLimitExceeded
    from celery_ratelimit import settle, observe
"""

from __future__ import annotations

from ._celery import startup  # noqa: F401  (connects the limiter's check at worker_ready)
from ._celery.decorator import ratelimit
from ._celery.install import install
from ._celery.observe import observe
from ._celery.settle import settle
from ._celery.task import RateLimitedTask
from ._engine.aio import AsyncLimiter
from ._engine.decision import Decision
from ._engine.exceptions import (
    InvalidLimit,
    InvalidRate,
    InvalidRedisURL,
    LimiterMisconfigured,
    LimiterUnavailable,
    RateLimitError,
    RateLimitExceeded,
)
from ._engine.limit import Concurrency, Limit
from ._engine.limiter import Limiter
from ._engine.rate import Rate
from ._engine.upstream import UpstreamRateLimited

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
