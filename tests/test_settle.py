"""Settling a call's real cost (``Limiter.settle``) against a real redis-server: a
refund frees budget at once, a surcharge delays the next grants and never the settled
call; per-limit costs of stacked limits; a reservation settled before it starts; the
counter and calendar-aligned limits; bad input refused by name. Time is Redis ``TIME``."""

from __future__ import annotations

import pytest
import redis

from celery_ratelimit import InvalidLimit, Limit, Limiter
from celery_ratelimit._engine.decision import token_bytes_of
from celery_ratelimit._engine.layout import redis_key
from tests.log_reader import entries, total
from tests.measure import server_us, us


def test_a_refund_frees_budget_at_once(limiter: Limiter, redis_client: redis.Redis) -> None:
    rate = Limit("10/m")
    first = limiter.acquire("k", rate, cost=8)
    assert first.allowed and first.token
    assert not limiter.acquire("k", rate, cost=5).allowed
    settled = limiter.settle(first.token, "k", rate, 2)
    assert settled.allowed and settled.remaining == 8
    assert limiter.acquire("k", rate, cost=5).allowed
    key = redis_key(limiter.prefix, "k", rate)
    assert sorted(w for _, w in entries(redis_client, key)) == [2, 5]
    assert total(redis_client, key) == 7
    # its instant stays where it was granted
    assert us(first.at) in [t for t, _ in entries(redis_client, key)]


def test_a_surcharge_delays_the_next_grants_not_the_settled_call(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("10/m")
    first = limiter.acquire("k", rate, cost=2)
    settled = limiter.settle(first.token, "k", rate, 25)  # type: ignore[arg-type]
    assert settled.allowed and settled.remaining == 0
    before = server_us(redis_client)
    denied = limiter.acquire("k", rate)
    # the window holds 25 of 10 until the settled call leaves it
    assert not denied.allowed
    assert us(first.at) + 60_000_000 - before - 1_000_000 <= us(denied.retry_after)
    assert us(denied.retry_after) <= us(first.at) + 60_000_000 - before + 1_000
    key = redis_key(limiter.prefix, "k", rate)
    assert entries(redis_client, key) == [(us(first.at), 25)]


def test_stacked_limits_take_one_cost_each(limiter: Limiter, redis_client: redis.Redis) -> None:
    units, calls = Limit("1000/m", key="llm:tokens"), Limit("5/m", key="llm:calls")
    d = limiter.acquire("llm", [units, calls], cost=[500, 1])
    assert limiter.settle(d.token, "llm", [units, calls], [120, 1]).allowed  # type: ignore[arg-type]
    assert total(redis_client, redis_key(limiter.prefix, "llm:tokens", units)) == 120
    assert total(redis_client, redis_key(limiter.prefix, "llm:calls", calls)) == 1
    assert limiter.acquire("llm", [units, calls], cost=[880, 1]).allowed


def test_a_reservation_settled_before_it_starts_keeps_its_slot(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("4/300ms")
    assert limiter.acquire("k", rate, cost=4).allowed
    held = limiter.acquire("k", rate, cost=3, reserve=True)
    assert held.reserved and held.token
    assert limiter.settle(held.token, "k", rate, 1).allowed
    key = redis_key(limiter.prefix, "k", rate)
    assert (us(held.at), 1) in entries(redis_client, key)
    assert redis_client.zscore(key + ":r", token_bytes_of(held.token)) == us(held.at)
    early = limiter.confirm(held.token, "k", rate, cost=1)
    assert early.reserved and early.at == held.at


def test_the_counter_and_an_aligned_day_count_the_difference(limiter: Limiter) -> None:
    # (windows long enough that none ends between the calls)
    for limits in (Limit("10/h", algorithm="counter"), Limit("10/d", align="UTC")):
        d = limiter.acquire("k", limits, cost=6)
        assert not limiter.acquire("k", limits, cost=6).allowed
        assert limiter.settle(d.token, "k", limits, 1).allowed  # type: ignore[arg-type]
        assert limiter.acquire("k", limits, cost=6).allowed
        limiter.reset("k")


def test_the_token_names_what_the_call_was_counted_at(limiter: Limiter) -> None:
    d = limiter.acquire("k", "10/m", cost=2)
    assert d.token and d.token.endswith(".2")
    settled = limiter.settle(d.token, "k", "10/m", 1)  # type: ignore[arg-type]
    assert settled.allowed and settled.remaining == 9
    # the old token names an entry of weight 2 no more; the one settle returned does
    assert not limiter.settle(d.token, "k", "10/m", 4).allowed  # type: ignore[arg-type]
    assert settled.token and limiter.settle(settled.token, "k", "10/m", 4).allowed
    assert limiter.peek("k", "10/m").remaining == 6


def test_nothing_to_settle_is_not_allowed(limiter: Limiter) -> None:
    assert not limiter.settle("00" * 8, "k", "10/m", 1).allowed


def test_bad_costs_are_refused_by_name(limiter: Limiter) -> None:
    d = limiter.acquire("k", "10/m")
    token = d.token
    assert token
    with pytest.raises(InvalidLimit, match="-1"):
        limiter.settle(token, "k", "10/m", -1)
    two = limiter.acquire("k", ["10/m", "20/h"], cost=[3, 1]).token
    assert two and two.endswith(".3,1")
    with pytest.raises(InvalidLimit, match="counted for 2 limits"):
        limiter.settle(two, "k", "10/m", 1)
    with pytest.raises(InvalidLimit, match="2 values of cost for 1 limits"):
        limiter.settle(token, "k", "10/m", [1, 2])
    with pytest.raises(InvalidLimit, match="token"):
        limiter.settle("nope", "k", "10/m", 1)
