"""The deferring worker's offset to Redis's clock (celery_ratelimit._celery.clock.observe).

A copy is published with ``eta`` = Redis's now + countdown, Redis's now being the local
clock plus this offset: an offset wrong by 150 ms makes the copy arrive 150 ms before its
slot, and its confirmation sends it back once more (seen in CI on a loaded machine).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_ratelimit import Decision, Limit, Limiter
from celery_ratelimit._celery import clock as _clock


@pytest.fixture(autouse=True)
def fresh_offset(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_clock, "_offset", None)
    monkeypatch.setattr(_clock, "_observed_rtt", float("inf"))
    monkeypatch.setattr(_clock, "_observed_at", -_clock.OFFSET_TTL)
    yield


def granted_at(redis_now: float) -> Decision:
    return Decision(allowed=True, remaining=1, retry_after=0.0, reset_after=1.0, at=redis_now)


def eta_offset() -> float:
    """Redis's now as redis_eta sees it, minus the local now."""
    return _clock.redis_eta(0.0).timestamp() - time.time()


def test_a_late_read_reply_does_not_replace_a_tight_sample() -> None:
    t = 1_000_000.0
    # Redis is 2 s ahead; read within 1 ms
    _clock.observe(granted_at(t + 2.0005), t, t + 0.001)
    # the same clocks, but this reply was read 300 ms after it was sent (the process
    # was descheduled): its midpoint is off by up to 150 ms
    _clock.observe(granted_at(t + 10.0 + 2.0001), t + 10.0, t + 10.3)
    assert eta_offset() == pytest.approx(2.0, abs=0.01)


def test_a_reserved_answer_counts_from_the_decision_not_the_slot() -> None:
    t = 1_000_000.0
    reserved = Decision(
        allowed=False, remaining=0, retry_after=4.0, reset_after=5.0, reserved=True, at=t + 4.0
    )
    _clock.observe(reserved, t - 0.001, t + 0.001)
    assert eta_offset() == pytest.approx(0.0, abs=0.01)


def test_an_old_sample_gives_way_to_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    t = 1_000_000.0
    _clock.observe(granted_at(t + 2.0), t - 0.0005, t + 0.0005)
    monkeypatch.setattr(_clock, "_observed_at", time.monotonic() - _clock.OFFSET_TTL - 1)
    # the clock was stepped since: a looser but newer sample is taken
    _clock.observe(granted_at(t + 100.0 + 5.0), t + 100.0 - 0.005, t + 100.0 + 0.005)
    assert eta_offset() == pytest.approx(5.0, abs=0.01)


def test_offset_from_real_decisions_on_this_machine_is_a_few_ms(redis_url: str) -> None:
    limiter = Limiter.from_url(redis_url, prefix="clock-test")
    limits = [Limit("1000000/s")]
    for _ in range(20):
        sent = time.time()
        decision = limiter.acquire("clock", limits)
        _clock.observe(decision, sent, time.time())
    # Redis runs on this machine's clock: only the round trip separates them
    assert abs(eta_offset()) < 0.02
    limiter.reset("clock", limits)


def test_a_stepped_clock_is_followed_at_once() -> None:
    t = 1_000_000.0
    _clock.observe(granted_at(t + 2.0), t - 0.0005, t + 0.0005)
    # the local clock was stepped 3 s back: even a loose sample rules the old offset out
    # (Redis read its clock between sent and answered, so the offset lies in 5 +- 0.15)
    _clock.observe(granted_at(t + 10.0 + 5.0), t + 10.0 - 0.15, t + 10.0 + 0.15)
    assert eta_offset() == pytest.approx(5.0, abs=0.01)
