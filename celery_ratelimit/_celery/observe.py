"""observe(headers): inside a task body, what the upstream's answer said of the running
task's limits, for every worker.

The body has just called the upstream and holds its response: its rate-limit headers
(``Retry-After``, ``RateLimit``, ``X-RateLimit-*``, ``x-ratelimit-*-requests`` and
``-tokens``) bring the shared budget of the task's keys in line with the upstream's
own count, before the next decision on any worker (see :meth:`Limiter.observe`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import current_task

from .._engine.exceptions import LimiterMisconfigured, LimiterUnavailable
from .check import DECISION_ATTR
from .plan import plan_for
from .settings import limiter_for

logger = logging.getLogger("celery_ratelimit")


def observe(headers: Any) -> bool:
    """Tell every worker what the upstream's response ``headers`` say of the running
    task's limit keys: a ``Retry-After`` pauses them, a remaining/reset pair caps what
    is granted until the reset, a stated quota lowers the limit (see
    :meth:`Limiter.observe`: a limit counted in calls follows the requests headers, one
    that weighs its calls the tokens headers). Calls granted after this task's own
    grant count against the remaining the upstream reported: it had not seen them.

    Headers it does not understand change nothing (one DEBUG line); a Redis failure is
    logged as a WARNING and changes nothing: the body's work is done.

    Returns:
        True when the headers said something the limiter wrote; False otherwise, and
        for an eager call or a task without limits.

    Raises:
        RuntimeError: called outside a task body.
        TypeError: ``headers`` is not headers (a mapping or (name, value) pairs).

    Example::

        response = httpx.post(url, json=payload)
        celery_ratelimit.observe(response.headers)
    """
    task = current_task
    if task is None or not getattr(task, "request", None):
        raise RuntimeError("celery_ratelimit.observe() is called in a task's body")
    request = task.request
    plan = plan_for(task)
    if plan is None or request.is_eager or request.called_directly:
        return False
    keys, _, limits = plan.resolve(tuple(request.args or ()), request.kwargs or {})
    decision = getattr(request, DECISION_ATTR, None)
    since = decision.at if decision is not None and decision.token is not None else None
    try:
        return limiter_for(task.app).observe(keys, headers, limits, since=since)
    except (LimiterUnavailable, LimiterMisconfigured) as exc:
        logger.warning(
            "ratelimit: %s[%s]: the upstream's headers were not recorded: %s",
            task.name,
            request.id,
            exc,
        )
        return False


__all__ = ["observe"]
