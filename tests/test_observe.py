"""What an upstream's headers say (``Limiter.observe``) against a real redis-server: no
call is granted beyond the remaining it reported before its reset, counting what was
granted after the observed call; a stated quota lowers the limit; ``Retry-After``
pauses; requests headers go to limits counted in calls, tokens headers to limits that
weigh them; unknown headers write nothing. Time is read from Redis ``TIME``."""

from __future__ import annotations

import asyncio
import time

import pytest

from celery_ratelimit import AsyncLimiter, Concurrency, InvalidLimit, Limit, Limiter
from celery_ratelimit._engine.headers import Observation
from celery_ratelimit._tools.ops import Seen, key_settings
from celery_ratelimit._tools.report import format_settings


def budget(remaining: int, reset: float, limit: int | None = None) -> dict[str, str]:
    headers = {"X-RateLimit-Remaining": str(remaining), "X-RateLimit-Reset": str(reset)}
    if limit is not None:
        headers["X-RateLimit-Limit"] = str(limit)
    return headers


@pytest.mark.parametrize("algorithm", ["log", "counter"])
def test_no_more_than_the_remaining_is_granted_before_the_reset(
    limiter: Limiter, algorithm: str
) -> None:
    limit = Limit("100/m", algorithm=algorithm)
    assert limiter.observe("api", budget(3, 2), limit)
    granted = [limiter.acquire("api", limit) for _ in range(5)]
    assert [d.allowed for d in granted] == [True] * 3 + [False] * 2
    assert granted[-1].limit == limit and 1.5 < granted[-1].retry_after <= 2.0


def test_status_shows_what_the_upstream_said(limiter: Limiter) -> None:
    limiter.observe("api", budget(3, 30, limit=4), "5/s")
    limiter.acquire("api", "5/s")
    (row,) = key_settings(limiter)
    (seen,) = row.seen
    # a reset in whole seconds may have come a second early: with the quota known, the
    # budget holds until then
    assert seen == Seen("log", 10**6, 2, seen.reset_in, 4) and 28 < seen.reset_in <= 29
    (line,) = format_settings([row])
    assert line.startswith("upstream api (log 1s): 2 left, full again in 28.")
    assert line.endswith("quota 4")


def test_a_denied_call_reserves_its_slot_at_the_reset(limiter: Limiter) -> None:
    limiter.observe("api", budget(0, 1), "100/m")
    reserved = limiter.acquire("api", "100/m", reserve=True)
    assert reserved.reserved and 0.9 < reserved.retry_after <= 1.0


def test_a_whole_second_reset_holds_the_budget_until_a_second_before_it_when_the_quota_is_known(
    limiter: Limiter,
) -> None:
    # the upstream rounded its reset up: it came in the second before; the quota (our own
    # log of it) paces the calls from then
    limiter.observe("api", budget(0, 3, limit=50), "50/5s")
    denied = limiter.acquire("api", "50/5s")
    assert not denied.allowed and 1.5 < denied.retry_after <= 2.0
    limiter.observe("other", {**budget(0, 3, limit=50), "X-RateLimit-Reset": "3.0"}, "50/5s")
    assert 2.5 < limiter.acquire("other", "50/5s").retry_after <= 3.0  # stated finely


def test_calls_granted_after_the_observed_one_count_against_what_it_reported(
    limiter: Limiter,
) -> None:
    observed = limiter.acquire("api", "100/m")
    later = [limiter.acquire("api", "100/m") for _ in range(3)]
    assert all(later)
    # the upstream counted only the observed call when it said 4 remain: 3 more were
    # granted since, so 1 is left
    limiter.observe("api", budget(4, 5), "100/m", since=observed.at)
    assert [limiter.acquire("api", "100/m").allowed for _ in range(2)] == [True, False]


def test_a_stated_quota_lowers_the_limit_and_outlives_its_reset(limiter: Limiter) -> None:
    limiter.observe("api", budget(10, 0.2, limit=2), "5/s")
    assert [limiter.acquire("api", "5/s").allowed for _ in range(3)] == [True, True, False]
    # a quota above the declared limit never raises it
    limiter.observe("other", budget(10, 0.2, limit=50), "5/s")
    assert [limiter.acquire("other", "5/s").allowed for _ in range(6)] == [True] * 5 + [False]


def test_a_quota_of_another_window_changes_only_the_budget(limiter: Limiter) -> None:
    headers = {"RateLimit-Policy": '"day";q=2;w=86400', "RateLimit": '"day";r=3;t=60'}
    limiter.observe("api", headers, "5/s")
    assert [limiter.acquire("api", "5/s").allowed for _ in range(4)] == [True] * 3 + [False]


def test_retry_after_pauses_every_limit_of_the_key(limiter: Limiter) -> None:
    limits = [Limit("5/s"), Concurrency(2)]
    assert limiter.observe("api", {"Retry-After": "2"}, limits)
    denied = limiter.acquire("api", limits)
    assert denied.paused and 1.5 < denied.retry_after <= 2.0


def test_requests_headers_go_to_calls_and_tokens_headers_to_weights(limiter: Limiter) -> None:
    calls, tokens = Limit("100/m", key="calls"), Limit("100000/m", key="tokens", cost=100)
    headers = {
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "20s",
        "x-ratelimit-remaining-tokens": "350",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    limiter.observe("llm", headers, [calls, tokens])
    granted = [limiter.acquire("llm", [calls, tokens], cost=[1, 100]) for _ in range(3)]
    assert [d.allowed for d in granted] == [True, True, False]
    assert granted[-1].limit == calls
    # the tokens budget: 350 - 2 * 100 leaves 150, room for one call of 100
    assert limiter.acquire("llm", tokens, cost=100).allowed
    assert not limiter.acquire("llm", tokens, cost=100).allowed
    assert limiter.acquire("llm", tokens, cost=50).allowed


def test_unknown_headers_write_nothing(limiter: Limiter) -> None:
    assert not limiter.observe("api", {"Content-Type": "text/html"}, "5/s")
    assert not limiter.observe("api", budget(-1, 5), "5/s")
    assert limiter.client.keys(f"{limiter.prefix}:*") == []  # (other tests' keys may be there)


def test_bad_headers_are_refused_by_name(limiter: Limiter) -> None:
    with pytest.raises(TypeError, match="'nope'"):
        limiter.observe("api", "nope", "5/s")


def test_async_limiter_observes_the_same_budget(redis_url: str, limiter: Limiter) -> None:
    async def observe() -> bool:
        async_limiter = AsyncLimiter.from_url(redis_url, prefix=limiter.prefix)
        try:
            return await async_limiter.observe("api", budget(1, 2), "5/s")
        finally:
            await async_limiter.aclose()

    assert asyncio.run(observe())
    assert [limiter.acquire("api", "5/s").allowed for _ in range(2)] == [True, False]


def test_adapt_halves_the_rate_once_a_window_and_gives_a_tenth_back_each_window(
    limiter: Limiter,
) -> None:
    limit = Limit("20/s", adapt=True)
    limiter.observed("api", Observation(0.001), limit)
    limiter.observed("api", Observation(0.001), limit)  # the same burst: no second cut
    time.sleep(0.01)
    assert [limiter.acquire("api", limit).allowed for _ in range(11)] == [True] * 10 + [False]
    (row,) = key_settings(limiter)
    assert row.effective == (("log", 10**6, 10),)
    assert (
        format_settings([row])[-1]
        == "adapting api (log 1s): effective 10/s (the declared rate when lower)"
    )
    time.sleep(1.05)  # a window without a 429: 10 + 20 / 10
    assert [limiter.acquire("api", limit).allowed for _ in range(13)] == [True] * 12 + [False]


def test_adapt_cuts_only_for_a_call_granted_a_window_after_the_last_cut(
    limiter: Limiter,
) -> None:
    limit = Limit("20/0.2s", adapt=True)
    early = limiter.acquire("api", limit)
    limiter.observed("api", Observation(0.001), limit, since=early.at)  # 10
    time.sleep(0.21)
    # sent before the cut: the upstream's window held calls sent at 20, no signal
    limiter.observed("api", Observation(0.001), limit, since=early.at)
    (row,) = key_settings(limiter)
    assert row.effective[0][2] >= 12
    late = limiter.acquire("api", limit)
    limiter.observed("api", Observation(0.001), limit, since=late.at)
    (row,) = key_settings(limiter)
    assert row.effective[0][2] <= 10


def test_adapt_never_goes_below_one_per_window(limiter: Limiter) -> None:
    limit = Limit("2/0.1s", adapt=True)
    for _ in range(3):
        limiter.observed("api", Observation(0.001), limit)
        time.sleep(0.11)
    limiter.observed("api", Observation(0.001), limit)
    (row,) = key_settings(limiter)
    assert row.effective == (("log", 100_000, 1),)


def test_a_limit_without_adapt_keeps_its_rate_through_a_retry_after(limiter: Limiter) -> None:
    limiter.observed("api", Observation(0.001), "4/s")
    time.sleep(0.01)
    assert [limiter.acquire("api", "4/s").allowed for _ in range(5)] == [True] * 4 + [False]


def test_adapt_on_a_concurrency_is_refused_when_declared() -> None:
    with pytest.raises(InvalidLimit, match=r"Concurrency\(2, key='erp'\) cannot adapt"):
        Concurrency(2, key="erp", adapt=True)
    with pytest.raises(TypeError, match="'yes'"):
        Limit("5/s", adapt="yes")  # type: ignore[arg-type]
