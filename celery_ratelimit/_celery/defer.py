"""The deferral: a task that may not start now is published again for later, and this
execution ends with ``Retry``.

The copy is the same task (same id, args, kwargs, links, chain, chord, group, queue,
priority, expires) with every header of its message, as ``self.retry()`` keeps them,
then ours (``ratelimit_*``, see ``check``), due after the countdown (an ``eta`` in Redis
time, which the receiving worker moves to its own clock: see ``clock``). It is
published *before* the original message is acknowledged: a crash in between can
duplicate a message, never lose one. Copies due far ahead may wait in Redis instead of
the broker (``park``).
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.exceptions import Reject, Retry
from celery.utils.time import maybe_iso8601

from .._engine.exceptions import RateLimitExceeded
from .._engine.limit import Concurrency, Limit
from .check import (
    DECISION_ATTR,
    DEFERRALS_HEADER,
    DENIALS_HEADER,
    OUR_HEADERS,
    RETRIES_HEADER,
    TOKEN_HEADER,
    _log_at_most_every,
    _process_settings,
)
from .clock import redis_eta
from .green import give_way
from .metrics import send_deferral_event
from .park import park
from .quiet import deferral
from .settings import setting

if TYPE_CHECKING:
    from .path import Path as Check

logger = logging.getLogger("celery_ratelimit")

#: A deferred copy is due this long after its slot: clock offsets are measured to
#: about a millisecond, and a copy arriving a hair early would cost a wait and a
#: second confirmation, one arriving a hair late costs nothing.
ETA_MARGIN = 0.005


@dataclass(frozen=True)
class Deferral:
    """Why and for how long a task is published again.

    ``token``: its reserved slot, if any. ``denial``: the task could not get budget
    (what ``ratelimit_max_deferrals`` counts; see ``DENIALS_HEADER``). ``why``: what the
    ``task-ratelimited`` event says (see ``send_deferral_event``)."""

    countdown: float
    token: str | None
    reason: str
    denied_by: Limit | Concurrency | None = None
    denial: bool = False
    why: str = "limit"


def defer(check: Check, d: Deferral) -> str | None:
    """Publish the task of ``check`` again ``d.countdown`` seconds from now and raise the
    ``Retry`` that ends this execution.

    When the publish failed and the task waited in this process instead (acks
    early: the original message is already acknowledged), returns the token to
    confirm after that wait (or None).

    Raises:
        Retry: published.
        Reject: the publish failed and the task is ``acks_late`` (requeued).
        RateLimitExceeded: a ``denial`` past ``ratelimit_max_deferrals``.
    """
    task, request, token = check.task, check.request, d.token
    deferrals = int(getattr(request, DEFERRALS_HEADER, 0) or 0)
    denials = int(getattr(request, DENIALS_HEADER, 0) or 0)
    if d.denial:
        max_deferrals = check.setting("ratelimit_max_deferrals")
        if max_deferrals is not None and denials >= max_deferrals:
            _give_back(check, token)
            raise RateLimitExceeded(
                f"{task.name}[{request.id}] was deferred {denials} "
                f"time{'s' * (denials != 1)} for want of budget "
                f"(ratelimit_max_deferrals={max_deferrals}); giving up: {d.reason}"
            )
        denials += 1
    # the bodies running beside it first (green pools); its slot stays where it was
    countdown = max(d.countdown - give_way(d.countdown), 0.0)
    if token and _expires_before(task, request, countdown):
        # Celery will end the copy as expired when it arrives; its slot would be wasted.
        _give_back(check, token)
        token = None
    signature = _copy(check, countdown, token, deferrals + 1, denials)
    parked = _park(check, signature, countdown, token)
    if not parked:
        try:
            signature.apply_async()
        except Exception as exc:
            return _publish_failed(check, exc, countdown, token)
    keys = ",".join(check.keys)
    logger.info(
        "ratelimit: deferred %s[%s] key %s for %.3fs (deferral %d%s%s; %s)",
        task.name,
        request.id,
        keys,
        countdown,
        deferrals + 1,
        ", slot reserved" if token else "",
        ", parked in Redis" if parked else "",
        d.reason,
    )
    if check.metrics is not None:
        check.metrics.deferral(check.plan.limits, d.denied_by)
    send_deferral_event(task, keys, countdown, deferrals + 1, bool(token), d.why)
    # Celery's own retry line for it is left out (see quiet): ours says more
    raise deferral(request.id, Retry(d.reason, when=countdown, sig=signature))


def _give_back(check: Check, token: str | None) -> None:
    """Release the reservation ``token`` (it leaves the reservations gauge)."""
    check.give_back(token)
    if token is not None and check.metrics is not None:
        check.metrics.released(check.plan.limits)


def _copy(check: Check, countdown: float, token: str | None, deferrals: int, denials: int) -> Any:
    """The signature of the task published again, due ``countdown`` from now: every
    header of its message (custom ones included, as ``self.retry()`` keeps them),
    then ours (``ratelimit_*``, a name of our own, so never one of the user's)."""
    request = check.request
    headers = {
        name: value
        for name, value in (request.headers or {}).items()
        if not name.startswith(OUR_HEADERS)
    }
    headers.update(
        (name, value)
        for name, value in vars(request).items()
        if name.startswith(OUR_HEADERS) and name != DECISION_ATTR
    )
    headers[DEFERRALS_HEADER] = deferrals
    headers[DENIALS_HEADER] = denials
    headers[TOKEN_HEADER] = token
    headers[RETRIES_HEADER] = request.retries
    return check.task.signature_from_request(
        request,
        check.args,
        check.kwargs,
        # in Redis time, since worker clocks may disagree (see clock)
        eta=redis_eta(countdown + ETA_MARGIN),
        retries=request.retries,
        headers=headers,
    )


def _park(check: Check, signature: Any, countdown: float, token: str | None) -> bool:
    """Park the copy in Redis if it is due later than ``ratelimit_park_after``, or if
    it is in line (``token``) for a concurrency slot that may be handed to it (see
    ``park``); False if it is to be published to the broker now: due sooner, parking
    off, no node's mover seen lately, or the park could not be written."""
    after = _process_settings(check.task).park_after
    # a call in line for a concurrency slot that may be handed to it waits in the park
    # however soon its turn is expected: a slot handed over sooner calls it in at once
    waiting = token.partition(".")[0] if check.handy and token else None
    if after is None or (countdown <= after and waiting is None):
        return False
    try:
        return park(check.task, signature, countdown + ETA_MARGIN, waiting)
    except Exception as exc:  # the broker still takes it
        interval = setting("ratelimit_warning_interval", check.task.app)
        if _log_at_most_every(interval, "park"):
            logger.warning(
                "ratelimit: could not park a deferred task in Redis (%s); publishing "
                "deferred tasks to the broker instead (next warning in %.0fs at the "
                "earliest)",
                exc,
                interval,
            )
        return False


def _publish_failed(
    check: Check, exc: Exception, countdown: float, token: str | None
) -> str | None:
    task, request = check.task, check.request
    if task.acks_late:
        logger.error(
            "ratelimit: could not re-publish %s[%s] (%s); rejecting it with requeue "
            "so the broker delivers it again",
            task.name,
            request.id,
            exc,
        )
        raise Reject(exc, requeue=True) from exc
    logger.error(
        "ratelimit: could not re-publish %s[%s] (%s); waiting %.3fs in this process "
        "instead, so the task is not lost",
        task.name,
        request.id,
        exc,
        countdown,
    )
    time.sleep(countdown)
    return token


def _expires_before(task: Any, request: Any, countdown: float) -> bool:
    """True if the task's ``expires`` passes before ``countdown`` seconds from now."""
    expires = request.expires
    if not expires:
        return False
    try:
        when = maybe_iso8601(expires) if isinstance(expires, str) else expires
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        now = task.app.now()
        if now.tzinfo is None:
            now = now.replace(tzinfo=datetime.timezone.utc)
        return bool(when <= now + datetime.timedelta(seconds=countdown))
    except (TypeError, ValueError, AttributeError):
        return False
