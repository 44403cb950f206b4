"""Fair shares (``Limit(fair_key=..., fair_weight=...)``): the declaration's checks, and
the slots waiting calls get from a real redis-server (``lua/lib/fair.lua``).

The slots are compared by rank, not by time: which call holds which slot does not
depend on how fast the machine is, only on the order the calls came in.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from typing import Any

import pytest
from celery import Celery

from celery_ratelimit import (
    AsyncLimiter,
    Concurrency,
    InvalidLimit,
    Limit,
    Limiter,
    RateLimitedTask,
    ratelimit,
)
from celery_ratelimit._celery.plan import plan_for
from celery_ratelimit._engine.fair import place_of, waiting_by_value
from celery_ratelimit._engine.layout import FAIR_STATE, FAIR_TAGS, PENDING, log_entries
from celery_ratelimit._engine.limit import to_limits
from celery_ratelimit._tools.explain import explain, format_explanation
from celery_ratelimit._tools.ops import status
from celery_ratelimit._tools.report import format_status
from tests.measure import max_in_window, server_us


@pytest.mark.parametrize("weight", [0, -1, math.nan, math.inf, "2", True, None])
def test_a_weight_not_a_positive_finite_number_is_refused_naming_it(weight: Any) -> None:
    with pytest.raises(ValueError, match="fair_weight must be a positive") as caught:
        Limit("10/s", fair_key="{tenant}", fair_weight=weight)
    assert repr(weight) in str(caught.value)


def test_a_fair_key_needs_a_log_limit_of_its_own() -> None:
    with pytest.raises(InvalidLimit, match="needs reserved slots"):
        Limit("10/s", algorithm="counter", fair_key="{tenant}")
    with pytest.raises(InvalidLimit, match="needs reserved slots"):
        Limit("100/d", align="UTC", fair_key="{tenant}")
    with pytest.raises(InvalidLimit, match="cannot be stacked"):
        to_limits([Limit("10/s", fair_key="t"), Limit("100/m", key="other")])


def test_a_fair_key_template_naming_an_argument_no_call_can_have_fails_when_declared() -> None:
    app = Celery("fair-check", set_as_current=False)
    with pytest.raises(InvalidLimit, match=r"task decorated names argument \{tenant\}"):

        @ratelimit("5/s", key="provider", fair_key="{tenant}")
        @app.task(shared=False, name="decorated")
        def decorated(i: int) -> None: ...


def test_a_weight_function_returning_zero_fails_that_call_only() -> None:
    app = Celery("fair-weights", set_as_current=False)
    weights = {"interactive": 9, "batch": 1}

    @ratelimit(
        "5/s", key="provider", fair_key="{kind}", fair_weight=lambda kind: weights.get(kind, 0)
    )
    @app.task(shared=False, name="classed")
    def classed(kind: str) -> None: ...

    plan = plan_for(classed)
    assert plan is not None
    assert plan.fair((), {"kind": "interactive"}) == ("interactive", 9.0)
    with pytest.raises(InvalidLimit, match=r"the weight fair_weight function of .* got 0"):
        plan.fair((), {"kind": "unknown"})


def _reserve(limiter: Limiter, limit: Limit, tenants: list[str], weight: dict[str, float]) -> str:
    """Ask for a slot for a call of each tenant in order; returns the limit's Redis key."""
    for tenant in tenants:
        d = limiter.acquire(
            "provider", limit, reserve=True, fair=tenant, fair_weight=weight.get(tenant, 1)
        )
        assert d.allowed or d.reserved
    return limiter.keys_for("provider", limit)[0]


def _order(limiter: Limiter, key: str) -> list[str]:
    """The tenants of the waiting calls, in the order of their slots as they are now."""
    state = limiter.client.hgetall(key + FAIR_STATE)
    members = limiter.client.zrange(key + PENDING, 0, -1)
    return [state[b"m:" + member].decode() for member in members]


def test_a_tenant_behind_a_backlog_takes_every_other_slot_and_no_window_overflows(
    limiter: Limiter,
) -> None:
    limit = Limit("5/s", key="provider", fair_key="{tenant}")
    key = _reserve(limiter, limit, ["A"] * 40 + ["B"] * 3, {})
    entries = log_entries(limiter.client, key)
    assert len(entries) == 43  # nothing lost, nothing counted twice
    assert len({t for t, _ in entries}) == 43  # a slot each: swaps exchange slots
    assert max_in_window([t for t, _ in entries], 1_000_000) <= 5
    slots = limiter.client.zrange(key + PENDING, 0, -1, withscores=True)
    assert sorted(int(s) for _, s in slots) == sorted(t for t, _ in entries)[5:]
    # in slot order, B's k-th call comes after at most about k of A's (equal weights)
    order = _order(limiter, key)
    for k in range(1, 4):
        before = order[: _nth(order, "B", k)].count("A")
        assert before <= k + 1, f"B's call {k} is placed after {before} of A's: {order}"
    assert waiting_by_value(limiter.client, key) == {"A": 35, "B": 3}
    lines = format_status(status(limiter), limiter.prefix, "redis://test")
    assert "waiting on provider by fair key: A 35, B 3" in lines
    limiter.reset("provider", limit)
    assert not limiter.client.exists(key + FAIR_TAGS, key + FAIR_STATE, key + PENDING)


@pytest.mark.parametrize("burst", [None, 1])
def test_a_paced_fair_limit_keeps_its_pace_and_a_tenant_named_like_the_pace_marker(
    limiter: Limiter, burst: int | None
) -> None:
    limit = Limit("5/s", key="provider", fair_key="{tenant}", burst=burst)
    key = _reserve(limiter, limit, ["pace"] * 20 + ["B"] * 3, {})
    times = sorted(t for t, _ in log_entries(limiter.client, key))
    assert len(set(times)) == 23  # nothing lost, a slot each
    assert max_in_window(times, 1_000_000) <= 5
    if burst:  # one call per interval (200 ms), swaps or not
        assert min(b - a for a, b in itertools.pairwise(times)) >= 200_000
    order = _order(limiter, key)
    assert order[: _nth(order, "B", 3)].count("pace") <= 4, order


def _nth(order: list[str], tenant: str, k: int) -> int:
    return [i for i, one in enumerate(order) if one == tenant][k - 1]


def test_weights_three_to_one_share_the_slots_three_to_one_while_both_wait(
    limiter: Limiter,
) -> None:
    limit = Limit("10/s", key="provider", fair_key="{tenant}")
    key = _reserve(limiter, limit, ["A"] * 60 + ["C"] * 60, {"A": 3, "C": 1})
    order = _order(limiter, key)
    both = order[: _nth(order, "C", 10) + 1]  # a stretch where both wait
    share = Counter(both)
    assert abs(share["A"] / len(both) - 0.75) <= 0.1, f"shares {dict(share)} of {order}"


def test_nobody_waiting_writes_no_queue_and_explain_reads_the_place(
    limiter: Limiter, redis_url: str
) -> None:
    limit = Limit("5/s", key="provider", fair_key="{tenant}")
    for _ in range(5):
        assert limiter.acquire("provider", limit, reserve=True, fair="A").allowed
    key = limiter.keys_for("provider", limit)[0]
    assert not limiter.client.exists(key + FAIR_TAGS, key + FAIR_STATE)
    _reserve(limiter, limit, ["A"] * 10, {})
    place = place_of(limiter.client, key, "B", 1.0, 1, server_us(limiter.client))
    assert (place.ahead, place.waiting) == (2, 10)  # A tagged 1 and 2, B 2: after them
    app = Celery("fair-explain", set_as_current=False)
    app.conf.update(ratelimit_redis_url=redis_url, ratelimit_key_prefix=limiter.prefix)

    @app.task(base=RateLimitedTask, ratelimit=limit, shared=False, name="call")
    def call(tenant: str) -> None: ...

    lines = format_explanation(explain(app, "call", ["B"]))
    assert any("2 of them" in line and "key B (weight 1)" in line for line in lines), lines


def test_concurrency_turns_go_to_the_waiting_tenants_in_turn(limiter: Limiter) -> None:
    slots = Concurrency(2, key="erp", fair_key="{tenant}")
    for tenant in ["A"] * 12 + ["B"] * 3:
        d = limiter.acquire("erp", slots, reserve=True, fair=tenant)
        assert d.allowed or d.reserved
    key = limiter.keys_for("erp", slots)[0]
    order = _order(limiter, key)  # the waiters, in the order of their turns
    assert sorted(order) == ["A"] * 10 + ["B"] * 3  # nobody lost, nobody twice
    for k in range(1, 4):
        before = order[: _nth(order, "B", k)].count("A")
        assert before <= k + 1, f"B's call {k} waits behind {before} of A's: {order}"
    with pytest.raises(ValueError, match="fair_weight must be a positive finite number"):
        Concurrency(2, key="erp", fair_key="{tenant}", fair_weight=math.nan)


def test_the_async_limiter_places_a_call_as_the_sync_one_does(
    redis_url: str, limiter: Limiter
) -> None:
    limit = Limit("5/s", key="provider", fair_key="{tenant}")
    key = _reserve(limiter, limit, ["A"] * 10, {})

    async def main() -> None:
        lim = AsyncLimiter.from_url(redis_url, prefix=limiter.prefix)
        try:
            d = await lim.acquire("provider", limit, reserve=True, fair="B")
            assert d.reserved
        finally:
            await lim.aclose()

    asyncio.run(main())
    assert _order(limiter, key) == ["A", "A", "B", "A", "A", "A"]  # 5 ran at once


def test_a_slot_taken_over_within_hold_starts_only_if_what_started_leaves_it_room(
    limiter: Limiter,
) -> None:
    """A fair call takes over a waiting call's slot (lib/fair.lua's swap); within ``hold``
    of now that is a start, and the room of that slot's window may be gone: calls that
    came after an outage took the room of slots whose tasks never came back (abandoned),
    not counting the reservations still to come. The slot taken over is a start only
    when it fits counting what really started, as a confirm is checked; otherwise it
    stays a reservation, placed anew by its confirm. No window starts more than 3."""
    limits = [Limit("3/s", key="k", fair_key="{t}")]
    options: dict[str, Any] = {"reserve": True, "hold": 0.2}
    starts: list[int] = []

    def started(decision: Any) -> None:
        assert decision.allowed, decision
        starts.append(round(decision.at * 1_000_000))

    for _ in range(3):  # a full window
        started(limiter.acquire("k", limits, fair="a", **options))
    # the next window's three (their tasks never come back: an outage deferred them
    # without their tokens) and the window after's three, all tenant a's
    lost = [limiter.acquire("k", limits, fair="a", **options) for _ in range(3)]
    waiting = [limiter.acquire("k", limits, fair="a", **options) for _ in range(3)]
    assert all(d.reserved for d in lost + waiting)
    # the lost slots are abandoned (overdue by more than a quarter window): fresh calls
    # take their room, not counting the waiting slots due later
    time.sleep(max(lost[-1].at + 0.35 - time.time(), 0.0))
    fresh = [limiter.acquire("k", limits, fair="a", **options) for _ in range(3)]
    for decision in fresh:
        if decision.allowed:
            started(decision)
    # tenant b comes just before the last waiting slot, and goes ahead of it
    time.sleep(max(waiting[-1].at - 0.12 - time.time(), 0.0))
    due = [(d.at, d.token, "a") for d in waiting] + [(0.0, None, "b")]
    while due:  # every call that waits starts as a worker would, at its slot
        due.sort(key=lambda call: call[0])
        at, token, tenant = due.pop(0)
        time.sleep(max(at - time.time(), 0.0))
        if token is None:
            decision = limiter.acquire("k", limits, fair=tenant, **options)
        else:
            decision = limiter.confirm(token, "k", limits, fair=tenant, hold=0.2)
        if decision.allowed:
            time.sleep(decision.retry_after)
            started(decision)
        else:
            due.append((time.time() + decision.retry_after, decision.token, tenant))
    assert max_in_window(sorted(starts), 1_000_000) <= 3, sorted(starts)
