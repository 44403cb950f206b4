"""AsyncLimiter against a real redis-server: the same scripts, keys and decisions as
Limiter (the two share one budget), every method as a coroutine, concurrent coroutines
counted exactly, and Redis failures translated as the sync limiter's are."""

from __future__ import annotations

import asyncio

import pytest

from celery_ratelimit import (
    AsyncLimiter,
    Concurrency,
    InvalidRate,
    InvalidRedisURL,
    Limit,
    Limiter,
    LimiterUnavailable,
)
from celery_ratelimit._tools.ops import key_settings
from tests.redis_server import RedisServer


def run(coroutine: object) -> object:
    return asyncio.run(coroutine)  # type: ignore[arg-type]


def test_async_and_sync_limiters_share_one_budget(redis_url: str, limiter: Limiter) -> None:
    async def main() -> list[bool]:
        lim = AsyncLimiter.from_url(redis_url, prefix=limiter.prefix)
        try:
            got = [(await lim.acquire("k", "4/m")).allowed for _ in range(2)]
            got += [limiter.acquire("k", "4/m").allowed for _ in range(2)]
            denied = await lim.acquire("k", "4/m")
            peeked = await lim.peek("k", "4/m")
            assert not denied.allowed and denied.retry_after > 55
            assert not peeked.allowed and peeked.remaining == 0
            assert denied.limit == Limit("4/m")
            return got
        finally:
            await lim.aclose()

    assert run(main()) == [True] * 4
    assert limiter.keys_for("k", "4/m") == [f"{limiter.prefix}:{{k}}:log:60000000"]


def test_concurrent_coroutines_are_counted_exactly(redis_url: str, limiter: Limiter) -> None:
    async def main() -> int:
        lim = AsyncLimiter.from_url(redis_url, prefix=limiter.prefix)
        try:
            answers = await asyncio.gather(*(lim.acquire("burst", "25/m") for _ in range(100)))
            return sum(d.allowed for d in answers)
        finally:
            await lim.aclose()

    assert run(main()) == 25


def test_reservations_slots_pauses_overrides_and_reset(redis_url: str, limiter: Limiter) -> None:
    async def main() -> None:
        lim = AsyncLimiter.from_url(redis_url, prefix=limiter.prefix)
        try:
            one = Limit("1/s")
            assert (await lim.acquire("r", one)).allowed
            slot = await lim.acquire("r", one, reserve=True)
            assert slot.reserved and slot.token and 0 < slot.retry_after <= 1
            await asyncio.sleep(slot.retry_after)
            assert (await lim.confirm(slot.token, "r", one)).allowed
            # a concurrency slot: held, renewed, released
            slots = [Concurrency(1, key="c")]
            held = await lim.acquire("c", slots)
            assert held.allowed and held.token
            assert not (await lim.acquire("c", slots)).allowed
            assert await lim.renew(held.token, "c", slots)
            await lim.release(held.token, "c", slots)
            assert (await lim.acquire("c", slots)).allowed
            # a pause, then an override, seen by the sync limiter too
            assert 0.9 < await lim.pause("p", 1) <= 1
            assert limiter.acquire("p", "5/s").paused
            await lim.override("o", "1/m", ttl=60)
            assert [str(s.override) for s in key_settings(limiter) if s.key == "o"] == ["1/m"]
            assert [limiter.acquire("o", "5/s").allowed for _ in range(2)] == [True, False]
            await lim.override("o", None)
            # reset: every window of the key, or one limit's
            assert sorted(await lim.reset("r")) == [f"{lim.prefix}:{{r}}:log:1000000"]
            assert await lim.reset("o", "5/s") == [f"{lim.prefix}:{{o}}:log:1000000"]
        finally:
            await lim.aclose()

    run(main())


def test_settle_and_an_aligned_day_as_the_sync_limiter(redis_url: str, limiter: Limiter) -> None:
    day = Limit("10/d", align="America/Los_Angeles")

    async def main() -> None:
        lim = AsyncLimiter.from_url(redis_url, prefix=limiter.prefix)
        try:
            granted = await lim.acquire("q", day, cost=8)
            assert granted.token and not (await lim.acquire("q", day, cost=5)).allowed
            settled = await lim.settle(granted.token, "q", day, 3)
            assert settled.allowed and settled.remaining == 7
        finally:
            await lim.aclose()

    run(main())
    # the same budget, seen by the sync limiter
    assert limiter.peek("q", day, cost=7).allowed and not limiter.peek("q", day, cost=8).allowed


def test_bad_input_and_a_stopped_redis_fail_as_the_sync_limiter_does() -> None:
    with pytest.raises(InvalidRedisURL, match="redis\\+sentinel"):
        AsyncLimiter.from_url("redis+sentinel://h:26379/mymaster")
    server = RedisServer()
    url = server.url
    server.close()

    async def main() -> None:
        lim = AsyncLimiter.from_url(url, socket_connect_timeout=0.5)
        try:
            with pytest.raises(InvalidRate, match="10/fortnight"):
                await lim.acquire("k", "10/fortnight")
            with pytest.raises(LimiterUnavailable):
                await lim.acquire("k", "10/s")
        finally:
            await lim.aclose()

    run(main())


def test_a_script_flush_between_its_reload_and_its_run_loses_no_call(
    redis_url: str, limiter: Limiter
) -> None:
    """As the sync limiter's: a SCRIPT FLUSH right after the reload that NOSCRIPT asked
    for, and the call is still decided (the script loaded once more)."""

    async def main() -> list[bool]:
        lim = AsyncLimiter.from_url(redis_url, prefix=limiter.prefix)
        try:
            got = [(await lim.acquire("race", "100/m")).allowed]
            load, loads = lim.client.script_load, []

            async def load_then_flush(script: str) -> str:
                sha = await load(script)
                loads.append(sha)
                if len(loads) % 2:  # every other load meets the flush
                    limiter.client.script_flush()
                return str(sha)

            lim.client.script_load = load_then_flush  # type: ignore[method-assign]
            for _ in range(2):
                limiter.client.script_flush()
                got.append((await lim.acquire("race", "100/m")).allowed)
            return got
        finally:
            await lim.aclose()

    assert run(main()) == [True] * 3
    assert limiter.peek("race", "100/m").remaining == 97
