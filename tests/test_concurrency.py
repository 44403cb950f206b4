"""Concurrency limits and pauses against a real redis-server: at most n slots held, all
or nothing with rate limits, leases that run out, turns in line, and pauses that hold
every call back. Time is read from Redis ``TIME``."""

from __future__ import annotations

import datetime
import email.utils
import itertools
import multiprocessing
import time
from typing import Any

import pytest

from celery_ratelimit import (
    Concurrency,
    InvalidLimit,
    Limit,
    Limiter,
    UpstreamRateLimited,
)
from celery_ratelimit._engine.layout import AVERAGE
from celery_ratelimit._engine.upstream import seconds_from
from tests.measure import server_us


def holders(limiter: Limiter, key: str, limit: Concurrency) -> list[bytes]:
    name = limiter.keys_for(key, [limit])[0]
    return [m for m in limiter.client.zrange(name + ":s", 0, -1)]


# -- declaration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((0,), {}, InvalidLimit),
        ((-1,), {}, InvalidLimit),
        ((True,), {}, TypeError),
        ((1.5,), {}, TypeError),
        ((2,), {"lease": 0}, InvalidLimit),
        ((2,), {"lease": "10"}, InvalidLimit),
        ((2,), {"key": ""}, InvalidLimit),
        ((2,), {"key": "{a}-{b}"}, InvalidLimit),
        ((2,), {"key": 5}, TypeError),
        ((2,), {"name": ""}, InvalidLimit),
    ],
)
def test_a_bad_concurrency_limit_fails_when_declared(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        Concurrency(*args, **kwargs)
    shown = kwargs.get("lease", kwargs.get("key", kwargs.get("name", args[0])))
    assert repr(shown) in str(info.value) or str(shown) in str(info.value)


def test_a_concurrency_limit_goes_after_the_rate_limits_it_is_checked_with() -> None:
    from celery_ratelimit._engine.limit import to_limits

    slots, rate = Concurrency(1, key="erp:{tenant}"), Limit("100/m", key="erp")
    assert to_limits([slots, rate]) == (rate, slots)
    assert slots.label == "erp:{tenant}@1 at once"
    assert Concurrency(3).label == "task@3 at once"


# -- slots -------------------------------------------------------------------------------


def test_at_most_n_calls_hold_a_slot_and_a_release_gives_one_back(limiter: Limiter) -> None:
    two = [Concurrency(2)]
    first, second = limiter.acquire("k", two), limiter.acquire("k", two)
    third = limiter.acquire("k", two)
    assert first.allowed and second.allowed and first.token and second.token
    assert not third.allowed and third.limit == two[0] and third.retry_after > 0
    assert third.remaining == 0 and not third.reserved
    limiter.release(first.token, "k", two)
    fourth = limiter.acquire("k", two)
    assert fourth.allowed and fourth.remaining == 0
    # a release of a token that holds nothing changes nothing
    limiter.release(first.token, "k", two)
    assert not limiter.acquire("k", two).allowed


def test_slots_are_shared_by_every_process(limiter: Limiter, redis_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        got = pool.starmap(_take, [(redis_url, limiter.prefix)] * 20)
    assert sum(got) == 3


def _take(url: str, prefix: str) -> int:
    limiter = Limiter.from_url(url, prefix=prefix)
    return int(limiter.acquire("shared", [Concurrency(3)]).allowed)


def test_a_lapsed_lease_gives_the_slot_back(limiter: Limiter) -> None:
    one = [Concurrency(1, lease=0.3)]
    held = limiter.acquire("k", one)
    assert held.allowed
    assert not limiter.acquire("k", one).allowed
    time.sleep(0.35)
    assert limiter.acquire("k", one).allowed
    # the lost holder's renewal says it no longer holds the slot
    assert held.token and not limiter.renew(held.token, "k", one)


def test_a_renewed_lease_keeps_the_slot(limiter: Limiter) -> None:
    one = [Concurrency(1, lease=1)]
    held = limiter.acquire("k", one)
    assert held.token
    for _ in range(4):
        time.sleep(0.3)
        assert limiter.renew(held.token, "k", one)
    assert not limiter.acquire("k", one).allowed


def test_a_peek_takes_no_slot(limiter: Limiter) -> None:
    one = [Concurrency(1)]
    assert limiter.peek("k", one).allowed
    assert limiter.peek("k", one).allowed
    held = limiter.acquire("k", one)
    assert held.allowed
    assert not limiter.peek("k", one).allowed


# -- all or nothing with rate limits -----------------------------------------------------


def test_a_rate_denial_takes_no_slot_and_a_full_limit_spends_no_budget(
    limiter: Limiter,
) -> None:
    both = [Limit("2/10s"), Concurrency(1)]
    first = limiter.acquire("k", both)
    assert first.allowed and first.token
    # the slot is taken: denied by the concurrency limit, no budget spent
    denied = limiter.acquire("k", both)
    assert not denied.allowed and isinstance(denied.limit, Concurrency)
    assert limiter.peek("k", [Limit("2/10s")]).remaining == 1
    limiter.release(first.token, "k", both)
    second = limiter.acquire("k", both)
    assert second.allowed and second.token
    limiter.release(second.token, "k", both)
    # the budget is spent: denied by the rate limit, no slot taken
    third = limiter.acquire("k", both)
    assert not third.allowed and third.limit == both[0]
    assert limiter.peek("k", [Concurrency(1)]).allowed


def test_the_counter_algorithm_checks_slots_too(limiter: Limiter) -> None:
    both = [Limit("5/s", algorithm="counter"), Concurrency(1)]
    first = limiter.acquire("k", both)
    assert first.allowed and first.token
    assert not limiter.acquire("k", both).allowed
    limiter.release(first.token, "k", both)
    assert limiter.acquire("k", both).allowed


# -- waiting in line ---------------------------------------------------------------------


def test_waiters_get_turns_in_order_one_average_body_apart(limiter: Limiter) -> None:
    one = [Concurrency(1)]
    # teach the limit that a body takes about 200 ms
    for _ in range(3):
        held = limiter.acquire("k", one)
        assert held.token
        time.sleep(0.2)
        limiter.release(held.token, "k", one)
    avg = limiter.client.zscore(limiter.keys_for("k", one)[0], AVERAGE)
    assert avg is not None and 180_000 <= avg <= 400_000
    running = limiter.acquire("k", one)
    waiters = [limiter.acquire("k", one, reserve=True) for _ in range(4)]
    assert all(w.reserved and w.token for w in waiters)
    turns = [w.at for w in waiters]
    assert turns == sorted(turns)
    gaps = [b - a for a, b in itertools.pairwise(turns)]
    assert all(abs(gap - avg / 1e6) < 0.01 for gap in gaps), gaps
    # the first waiter, on time, gets the slot the running body gives back
    assert running.token
    limiter.release(running.token, "k", one)
    first = waiters[0]
    assert first.token
    started = limiter.confirm(first.token, "k", one)
    assert started.allowed
    # a later waiter, early, waits behind the body now running
    later = waiters[1]
    assert later.token
    early = limiter.confirm(later.token, "k", one)
    assert not early.allowed and early.reserved and early.retry_after > 0


def test_one_body_released_late_does_not_push_the_line_far_ahead(limiter: Limiter) -> None:
    """A body whose release comes a second late (Redis stopped, a stalled worker) moves
    the average a body takes, by which waiters' turns are placed, by a quarter of twice
    it at most: a line placed just after an outage is not placed ten times too far."""
    one = [Concurrency(1)]
    for _ in range(3):  # about 100 ms a body
        held = limiter.acquire("k", one)
        assert held.token
        time.sleep(0.1)
        limiter.release(held.token, "k", one)
    before = limiter.client.zscore(limiter.keys_for("k", one)[0], AVERAGE)
    assert before is not None
    held = limiter.acquire("k", one)
    assert held.token
    time.sleep(1.0)
    limiter.release(held.token, "k", one)
    after = limiter.client.zscore(limiter.keys_for("k", one)[0], AVERAGE)
    assert after is not None and before < after <= 1.25 * before + 1


def test_a_new_call_does_not_take_the_slot_of_a_waiter_whose_turn_has_come(
    limiter: Limiter,
) -> None:
    one = [Concurrency(1)]
    running = limiter.acquire("k", one)
    waiter = limiter.acquire("k", one, reserve=True)
    assert running.token and waiter.reserved and waiter.token
    limiter.release(running.token, "k", one)
    while server_us(limiter.client) < waiter.at * 1e6:
        time.sleep(0.01)
    assert not limiter.acquire("k", one).allowed  # the waiter's turn
    assert limiter.confirm(waiter.token, "k", one).allowed


def test_a_waiter_that_never_comes_gives_its_turn_up(limiter: Limiter) -> None:
    """... also once handed it: the handed slot's lease is its turn plus the grace."""
    one = [Concurrency(1)]
    running = limiter.acquire("k", one)
    waiter = limiter.acquire("k", one, reserve=True)
    assert running.token and waiter.reserved and waiter.token
    limiter.release(running.token, "k", one)
    assert holders(limiter, "k", one[0]) == [bytes.fromhex(waiter.token)]  # handed
    deadline = waiter.at + 2.2  # its turn plus the grace (lua/lib/concurrency.lua GRACE)
    while server_us(limiter.client) < deadline * 1e6:
        time.sleep(0.05)
    assert limiter.acquire("k", one).allowed


def test_a_reservation_held_back_only_by_busy_slots_keeps_its_rate_slot(
    limiter: Limiter,
) -> None:
    """A reserved copy on time for its rate slot while every concurrency slot is still
    held comes back at its turn in line, not behind the whole reserved line."""
    both: list[Any] = [Limit("2/s"), Concurrency(2)]
    running = [limiter.acquire("k", both, hold=0.2) for _ in range(2)]
    assert all(r.allowed and r.token for r in running)
    line = [limiter.acquire("k", both, reserve=True, hold=0.2) for _ in range(8)]
    assert all(w.reserved and w.token for w in line)
    assert line[-1].at - line[0].at >= 3.0  # the line reaches 4 s ahead
    first = line[0]
    assert first.token
    while server_us(limiter.client) < first.at * 1e6:
        time.sleep(0.01)
    again = limiter.confirm(first.token, "k", both, hold=0.2)
    assert again.reserved and again.token == first.token
    assert again.retry_after < 1.0, again  # its turn, not after the 8th reservation
    # a body ends: at its turn the copy starts, in the room its slot kept
    limiter.release(running[0].token or "", "k", both)
    while server_us(limiter.client) < again.at * 1e6:
        time.sleep(0.01)
    started = limiter.confirm(first.token, "k", both, hold=0.2)
    assert started.allowed
    assert bytes.fromhex(first.token) in holders(limiter, "k", both[1])


def test_an_early_reservation_held_back_by_busy_slots_comes_back_not_before_its_slot(
    limiter: Limiter,
) -> None:
    both: list[Any] = [Limit("2/s"), Concurrency(2)]
    for _ in range(3):  # bodies of about 20 ms: a turn is expected moments away
        held = limiter.acquire("k", both[1:])
        assert held.token
        time.sleep(0.02)
        limiter.release(held.token, "k", both[1:])
    running = [limiter.acquire("k", both, hold=0.2) for _ in range(2)]
    assert all(r.allowed for r in running)
    first = limiter.acquire("k", both, reserve=True, hold=0.2)
    assert first.reserved and first.token
    while server_us(limiter.client) < (first.at - 0.1) * 1e6:
        time.sleep(0.01)
    early = limiter.confirm(first.token, "k", both, hold=0.2)
    assert early.reserved and early.token == first.token
    assert early.at >= first.at, (early.at, first.at)


# -- a turn handed over ------------------------------------------------------------------


def test_a_body_that_ends_hands_its_slot_to_the_first_waiter(limiter: Limiter) -> None:
    one = [Concurrency(1)]
    running = limiter.acquire("k", one)
    first, second = (limiter.acquire("k", one, reserve=True) for _ in range(2))
    assert running.token and first.token and second.token and first.reserved
    assert limiter.handed(first.token, "k", one, 0.05) is None  # nothing handed yet
    limiter.release(running.token, "k", one)
    # the first waiter holds the slot at once: nobody else gets it, n is never exceeded
    assert holders(limiter, "k", one[0]) == [bytes.fromhex(first.token)]
    assert not limiter.acquire("k", one).allowed
    ends = limiter.handed(first.token, "k", one, 0.5)
    assert ends is not None and ends > server_us(limiter.client) / 1e6
    assert limiter.handed(second.token, "k", one, 0.05) is None  # not its turn
    # its body ends: the next waiter's copy finds its turn held for it when it confirms
    limiter.release(first.token, "k", one)
    assert limiter.confirm(second.token, "k", one).allowed
    assert holders(limiter, "k", one[0]) == [bytes.fromhex(second.token)]
    limiter.release(second.token, "k", one)
    assert holders(limiter, "k", one[0]) == []


def test_a_second_delivery_of_a_handed_turn_takes_no_second_slot(limiter: Limiter) -> None:
    two = [Concurrency(2)]
    running = [limiter.acquire("k", two) for _ in range(2)]
    waiter = limiter.acquire("k", two, reserve=True)
    assert waiter.token and all(r.token for r in running)
    limiter.release(running[0].token or "", "k", two)
    assert limiter.handed(waiter.token, "k", two, 0.5) is not None  # its body runs
    again = limiter.confirm(waiter.token, "k", two)  # the same message delivered again
    assert len(holders(limiter, "k", two[0])) <= 2
    if again.allowed:
        assert again.token
        limiter.release(again.token, "k", two)
    assert bytes.fromhex(waiter.token) in holders(limiter, "k", two[0])


def test_a_call_with_another_limit_is_not_handed_a_turn(limiter: Limiter) -> None:
    both: list[Any] = [Limit("100/s"), Concurrency(1)]
    running = limiter.acquire("k", both)
    waiter = limiter.acquire("k", both, reserve=True)
    assert running.token and waiter.reserved and waiter.token
    limiter.release(running.token, "k", both)
    assert holders(limiter, "k", both[1]) == []  # the slot is free: its copy confirms
    with pytest.raises(InvalidLimit):
        limiter.handed(waiter.token, "k", both, 0.05)


def test_a_paused_key_hands_no_turn_over(limiter: Limiter) -> None:
    one = [Concurrency(1)]
    running = limiter.acquire("k", one)
    waiter = limiter.acquire("k", one, reserve=True)
    assert running.token and waiter.token
    limiter.pause("k", 5)
    limiter.release(running.token, "k", one)
    assert holders(limiter, "k", one[0]) == []
    assert limiter.handed(waiter.token, "k", one, 0.05) is None
    assert not limiter.confirm(waiter.token, "k", one).allowed


# -- pauses ------------------------------------------------------------------------------


def test_a_paused_key_grants_nothing_until_the_pause_ends(limiter: Limiter) -> None:
    assert limiter.acquire("k", "10/s").allowed
    assert limiter.pause("k", 1) == pytest.approx(1, abs=0.01)
    denied = limiter.acquire("k", "10/s")
    assert not denied.allowed and denied.paused and denied.limit is None
    assert 0 < denied.retry_after <= 1
    peeked = limiter.peek("k", [Limit("10/s"), Concurrency(2)])
    assert not peeked.allowed and peeked.paused
    reserved = limiter.acquire("k", "10/s", reserve=True)
    assert reserved.reserved and reserved.paused
    assert reserved.at >= denied.at + denied.retry_after - 0.001
    # other keys are not paused
    assert limiter.acquire("other", "10/s").allowed
    time.sleep(1)
    assert limiter.acquire("k", "10/s").allowed


def test_a_longer_pause_already_in_place_stays(limiter: Limiter) -> None:
    assert limiter.pause("k", 5) == pytest.approx(5, abs=0.01)
    assert 4 < limiter.pause("k", 1) <= 5
    assert limiter.acquire("k", [Concurrency(1)]).retry_after > 4


def test_a_pause_applies_to_concurrency_limits_and_every_window(limiter: Limiter) -> None:
    limiter.pause("k", 1)
    for limits in ([Concurrency(3)], [Limit("5/s"), Limit("100/h")], "1/d"):
        decision = limiter.acquire("k", limits)
        assert not decision.allowed and decision.paused


@pytest.mark.parametrize(
    "value",
    [
        2,
        2.0,
        "2",
        b"2",
        datetime.timedelta(seconds=2),
        "http-date",
        "datetime",
    ],
)
def test_retry_after_is_read_from_seconds_a_header_or_a_datetime(value: Any) -> None:
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=2.5)
    if value == "http-date":
        value = email.utils.format_datetime(later, usegmt=True)  # whole seconds
    elif value == "datetime":
        value = later
    assert 1.0 <= seconds_from(value) <= 2.5
    assert UpstreamRateLimited(value).seconds == pytest.approx(seconds_from(value), abs=0.1)


@pytest.mark.parametrize("value", ["soon", True, None, float("nan"), [1], "Mon, 99 Foo"])
def test_a_bad_retry_after_is_refused_naming_it(value: Any) -> None:
    if value is None:
        assert UpstreamRateLimited(value).seconds == 1.0  # no Retry-After: the default
        return
    with pytest.raises(InvalidLimit, match=r"(?i)retry"):
        seconds_from(value)


def test_a_past_retry_after_is_no_pause() -> None:
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=30)
    assert seconds_from(past) == 0.0
    assert seconds_from(-3) == 0.0
