"""One decision by the name of what it asks, through the limiter's public methods, for
Redis keys a test holds (from ``Limiter.keys_for``): the tests of timing rules name the
operation they exercise."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_ratelimit import Decision, Limiter
from celery_ratelimit._engine.layout import parse_key

ACQUIRE, RESERVE, PEEK, CONFIRM, RESTAMP, RELEASE = (
    "acquire",
    "reserve",
    "peek",
    "confirm",
    "restamp",
    "release",
)


def decide(
    limiter: Limiter,
    redis_keys: Sequence[str],
    limits: tuple[Any, ...],
    cost: int | Sequence[int],
    mode: str,
    *,
    token: str | None = None,
    hold: float = 0.0,
    guard: float = 0.0,
) -> Decision | None:
    """``mode``'s public method for the logical keys of ``redis_keys`` (None: a release)."""
    names = [parse_key(limiter.prefix, key) for key in redis_keys]
    keys = tuple(name.key for name in names if name is not None)  # as the calls gave them
    if mode == PEEK:
        return limiter.peek(keys, limits, cost, guard=guard)
    if mode == RELEASE:
        assert token is not None
        limiter.release(token, keys, limits, cost)
        return None
    if mode in (CONFIRM, RESTAMP):
        assert token is not None
        method = limiter.confirm if mode == CONFIRM else limiter.restamp
        return method(token, keys, limits, cost, hold=hold, guard=guard)
    return limiter.acquire(keys, limits, cost, reserve=mode == RESERVE, hold=hold, guard=guard)
