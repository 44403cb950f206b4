"""The package exports the names DESIGN.md promises, and only importable ones."""

from __future__ import annotations

import importlib
import inspect

import celery_ratelimit

CONTRACT = {
    "Limit",
    "Limiter",
    "Decision",
    "RateLimitedTask",
    "ratelimit",
    "install",
    "RateLimitError",
    "RateLimitExceeded",
    # Contract additions (0.2)
    "Concurrency",
    "UpstreamRateLimited",
    "AsyncLimiter",
    "settle",
    # Contract additions (0.3)
    "observe",
}


def test_contract_additions_have_their_methods() -> None:
    from celery_ratelimit import AsyncLimiter, Limiter

    assert callable(Limiter.pause)
    assert callable(Limiter.release)
    assert callable(Limiter.override)
    for name in (
        "acquire",
        "peek",
        "confirm",
        "release",
        "renew",
        "pause",
        "resume",
        "override",
        "reset",
        "settle",
        "observe",
    ):
        assert callable(getattr(Limiter, name))
        assert inspect.iscoroutinefunction(getattr(AsyncLimiter, name)), name


def test_every_contract_name_is_exported() -> None:
    assert CONTRACT - set(celery_ratelimit.__all__) == set()


def test_everything_exported_is_importable_and_public() -> None:
    module = importlib.import_module("celery_ratelimit")
    for name in celery_ratelimit.__all__:
        assert not name.startswith("_")
        assert getattr(module, name) is not None, name
    assert len(set(celery_ratelimit.__all__)) == len(celery_ratelimit.__all__)


def test_exception_tree_has_one_root() -> None:
    from celery_ratelimit import (
        InvalidLimit,
        InvalidRate,
        LimiterMisconfigured,
        LimiterUnavailable,
        RateLimitError,
        RateLimitExceeded,
    )

    for exc in (
        InvalidLimit,
        InvalidRate,
        LimiterMisconfigured,
        LimiterUnavailable,
        RateLimitExceeded,
    ):
        assert issubclass(exc, RateLimitError)
    assert issubclass(InvalidRate, ValueError) and issubclass(InvalidLimit, ValueError)


def test_decision_is_frozen_and_truthy_when_allowed() -> None:
    import dataclasses

    import pytest

    from celery_ratelimit import Decision

    decision = Decision(allowed=True, remaining=3, retry_after=0.0, reset_after=1.0)
    assert decision and not Decision(allowed=False, remaining=0, retry_after=1.0, reset_after=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.allowed = False  # type: ignore[misc]
    assert {f.name for f in dataclasses.fields(Decision)} >= {
        "allowed",
        "remaining",
        "retry_after",
        "reset_after",
        "limit",
    }
