"""Even pacing (``Limit(rate, burst=N)``): the scripts against a pure-Python model of a
GCRA pace beside the sliding window, declaration errors, and the pace's reads.

As in ``test_limiter_properties``, Redis time cannot be steered: the model is fed the
server's own instants (``Decision.at``; ``at - retry_after`` for a reservation)."""

from __future__ import annotations

import itertools
import time

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from celery_ratelimit import InvalidLimit, Limit, Limiter, ratelimit
from celery_ratelimit._engine.layout import PACE_FIELD, PACE_MEMBER, parse_key
from celery_ratelimit._tools.ops import key_status, pace_in
from tests.measure import max_weight_in_window, server_us, us
from tests.test_limiter_properties import against_redis, earliest_fit, uses_abandoned_room

LIMIT, WINDOW_US = 6, 120_000
INTERVAL = WINDOW_US // LIMIT  # 20 ms: the emission interval, ceil(W / L)
_examples = itertools.count()


def pace_fit(tat: int, now: int, cost: int, burst: int) -> int:
    """The pace's model (GCRA): a call of ``cost`` conforms from tat - (burst - cost) T
    on (a cost above the burst: once the pace has caught up)."""
    return max(now, tat - max(burst - cost, 0) * INTERVAL)


operation = st.tuples(
    st.integers(1, LIMIT),  # cost
    st.integers(0, 40),  # milliseconds to wait before the call
    st.booleans(),  # reserve when denied
)


@against_redis
@given(burst=st.integers(1, LIMIT), ops=st.lists(operation, min_size=1, max_size=14))
def test_a_paced_log_decides_like_the_window_and_gcra_model(
    limiter: Limiter, redis_client: redis.Redis, burst: int, ops: list[tuple[int, int, bool]]
) -> None:
    """Weighted calls, some reserving: every grant, reservation and retry_after is the
    window's first fit from the instant the call conforms to the pace, exactly."""
    name = f"paced-{next(_examples)}"
    rate = Limit(f"{LIMIT}/120ms", burst=burst)
    log: list[tuple[int, int]] = []
    grants: list[tuple[int, int]] = []
    slots: list[tuple[int, int]] = []
    tat = 0
    for cost, wait_ms, reserve in ops:
        time.sleep(wait_ms / 1000)
        d = limiter.acquire(name, rate, cost=cost, reserve=reserve)
        if d.allowed:
            at = now = us(d.at)
            assert pace_fit(tat, now, cost, burst) == now
            if earliest_fit(log, now, cost) != now:
                # the room of a slot whose task never came: it fits among what started
                assert uses_abandoned_room(grants, slots, now, cost), (log, now, cost)
            grants.append((at, cost))
        else:
            at = us(d.at)
            now = at - us(d.retry_after) if d.reserved else at
            # the window's first fit from the instant the call conforms to the pace
            expected = earliest_fit(log, pace_fit(tat, now, cost, burst), cost)
            if d.reserved:
                assert at == expected > now
                slots.append((at, cost))
            else:
                assert not reserve
                assert now + us(d.retry_after) == expected > now
                continue
        log.append((at, cost))
        tat = max(tat, at) + cost * INTERVAL
    # the grants and slots together: never more than the burst plus the pace allows
    placed = sorted(log)
    for i, (first, _) in enumerate(placed):
        for last, _ in placed[i:]:
            units = sum(w for t, w in placed if first <= t <= last)
            heaviest = max(w for t, w in placed if first <= t <= last)
            assert units <= max(burst, heaviest) + (last - first) // INTERVAL
    assert max_weight_in_window(grants, WINDOW_US) <= LIMIT


def test_a_paced_counter_waits_for_its_pace(limiter: Limiter) -> None:
    rate = Limit("20/2s", burst=2, algorithm="counter")
    first, second, third = (limiter.acquire("counted", rate) for _ in range(3))
    assert first.allowed and second.allowed and not third.allowed
    # the third unit conforms one interval (100 ms) after the first
    assert 0 < third.retry_after <= 0.1
    assert us(first.at) + 100_000 - us(third.at) == us(third.retry_after)


def test_a_backlog_of_reservations_is_paced_one_interval_apart(limiter: Limiter) -> None:
    rate = Limit("20/2s", burst=3)
    decisions = [limiter.acquire("backlog", rate, reserve=True) for _ in range(10)]
    assert [d.allowed for d in decisions[:3]] == [True] * 3
    slots = [us(d.at) for d in decisions[3:]]
    assert all(d.reserved for d in decisions[3:])
    assert [b - a for a, b in itertools.pairwise(slots)] == [100_000] * 6
    # the first slot: one interval after the first grant, less the burst's tolerance
    assert slots[0] == us(decisions[0].at) + 100_000


def test_an_unpaced_limit_keeps_no_pace(limiter: Limiter, redis_client: redis.Redis) -> None:
    plain, paced = Limit("5/s", key="plain"), Limit("5/s", key="paced", burst=1)
    counter = Limit("5/s", key="counted", algorithm="counter", burst=1)
    for limit in (plain, paced, counter):
        assert limiter.acquire(limit.key, limit).allowed  # type: ignore[arg-type]
    (plain_key,) = limiter.keys_for("plain", plain)
    (paced_key,) = limiter.keys_for("paced", paced)
    (counter_key,) = limiter.keys_for("counted", counter)
    assert redis_client.zscore(plain_key, PACE_MEMBER) is None
    assert redis_client.zscore(paced_key, PACE_MEMBER) is not None
    assert redis_client.hget(counter_key, PACE_FIELD) is not None
    # what status and explain read: the next unit conforms one interval (200 ms) on
    now = server_us(redis_client)
    name = parse_key(limiter.prefix, paced_key)
    assert name is not None and key_status(redis_client, name, now).used == 1
    left = pace_in(redis_client, name, paced, now, None)
    assert left is not None and 0 < left <= 0.2
    assert pace_in(redis_client, name, plain, now, None) is None


def test_a_denial_by_a_paced_limit_consumes_nothing_from_the_others(limiter: Limiter) -> None:
    paced, window = Limit("10/s", key="api", burst=1), Limit("100/m", key="api:day")
    assert limiter.acquire("x", [paced, window]).allowed
    denied = limiter.acquire("x", [paced, window])
    assert not denied.allowed and denied.limit == paced
    assert limiter.peek("x", [window]).remaining == 99


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"burst": 0}, "burst must be a positive int or None, got 0"),
        ({"burst": -1}, "got -1"),
        ({"burst": 2.5}, "got 2.5"),
        ({"burst": True}, "got True"),
        ({"burst": "3"}, "got '3'"),
        ({"burst": 11}, "burst 11 is greater than the limit of 10/s"),
        ({"burst": 2, "align": "UTC", "rate": "10/m"}, "align='UTC'"),
    ],
)
def test_a_bad_burst_is_refused_at_declaration(kwargs: dict[str, object], match: str) -> None:
    rate = kwargs.pop("rate", "10/s")
    with pytest.raises(InvalidLimit, match=match):
        Limit(rate, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidLimit, match=match):
        ratelimit(rate, **kwargs)  # type: ignore[arg-type]


def test_a_paced_call_runs_a_script_composed_with_the_pace_and_sends_its_bursts() -> None:
    """Each sliding limit sends its burst (0: not paced) after (limit, window, cost), at
    the same place in every call: no marker. Only a paced call's acquisition, start and
    counter carry lib/pace.lua; a release or a settle never moves a pace."""
    from celery_ratelimit._engine.scripts import shape, source

    plain = shape((Limit("10/s"),), 1)
    assert plain.plain and plain.script("acquire") == "acquire_one"
    assert plain.arguments()[6:] == [0, 10, 1_000_000, 1, 0]  # lead, then the limit's four
    assert plain.script("start") == "start+log"
    paced = shape((Limit("10/s", burst=2), Limit("5/s", key="b")), 1)
    assert not paced.plain
    assert paced.arguments()[7:] == [10, 1_000_000, 1, 2, 5, 1_000_000, 1, 0]
    assert paced.script("acquire") == "acquire_full+log+pace"
    assert paced.script("start") == "start+log+pace"
    assert paced.script("release") == "release+log"
    assert "local function pace_take" in source("start+log+pace")
    assert "local function pace_take" not in source("start+log")
    counted = shape((Limit("10/s", burst=2, algorithm="counter"),), 1)
    assert counted.script("counter") == "counter+pace"


def test_async_and_sync_limiters_share_one_pace(redis_url: str, limiter: Limiter) -> None:
    import asyncio

    from celery_ratelimit import AsyncLimiter

    rate = Limit("20/2s", key="shared", burst=1)

    async def main() -> tuple[bool, float]:
        lim = AsyncLimiter.from_url(redis_url, prefix=limiter.prefix)
        try:
            first = await lim.acquire("shared", rate)
            reserved = await lim.acquire("shared", rate, reserve=True)
            assert reserved.reserved
            return first.allowed, reserved.at - first.at
        finally:
            await lim.aclose()

    allowed, gap = asyncio.run(main())
    assert allowed and abs(gap - 0.1) < 1e-6
    after = limiter.acquire("shared", rate, reserve=True)
    assert after.reserved and 0.1 < after.retry_after <= 0.2


def test_the_decorator_builds_a_paced_limit() -> None:
    decorate = ratelimit("10/s", key="k", burst=3)
    from celery import Celery

    app = Celery("pacing", set_as_current=False)

    @decorate
    @app.task
    def paced_task() -> None: ...

    (limit,) = paced_task.ratelimit
    assert limit == Limit("10/s", key="k", burst=3) and limit.burst == 3


def test_copies_that_come_late_never_bunch_their_starts(limiter: Limiter) -> None:
    """Three reserved slots 100 ms apart, their copies all confirmed together once every
    slot has passed: the first starts, the others do not start in the same interval (a
    window of one interval holds at most the burst, counting what really started)."""
    rate = Limit("20/2s", key="late", burst=1)
    assert limiter.acquire("late", rate).allowed
    tokens = [limiter.acquire("late", rate, reserve=True) for _ in range(3)]
    assert all(d.reserved for d in tokens)
    time.sleep(tokens[-1].at - tokens[0].at + tokens[0].retry_after + 0.05)
    starts = [limiter.confirm(d.token or "", "late", rate, hold=0.2) for d in tokens]
    assert starts[0].allowed and starts[0].retry_after == 0
    # each later one waits in-process for the next interval (or is placed anew): never
    # two starts of burst 1 within one interval
    instants = sorted(us(d.at) for d in starts)
    assert all(b - a >= INTERVAL * 5 for a, b in itertools.pairwise(instants)), instants


def test_status_shows_when_a_paced_limits_next_unit_conforms() -> None:
    from celery_ratelimit._engine.layout import KeyName
    from celery_ratelimit._tools.ops import KeyStatus
    from celery_ratelimit._tools.report import format_status

    paced = Limit("20/2s", key="api", burst=2)
    name = KeyName("ratelimit:{api}:log:2000000", "api", "log", 2_000_000)
    row = KeyStatus(name, used=2, limit=paced, sources=["task"], remaining=18, next_free=0.1)
    row.pace_in = 0.1
    (line,) = [text for text in format_status([row], "ratelimit", "redis://x") if "api@" in text]
    assert "paced, burst 2: next unit in 0.100s" in line


def test_explain_shows_a_paced_limits_pace() -> None:
    from celery_ratelimit._engine.layout import KeyName
    from celery_ratelimit._tools.explain import Explanation, LimitExplanation, format_explanation
    from celery_ratelimit._tools.ops import KeyStatus

    paced = Limit("20/2s", key="api", burst=2)
    state = KeyStatus(KeyName("k", "api", "log", 2_000_000), used=2, remaining=18, next_free=0.0)
    state.pace_in = 0.05
    e = Explanation("t", "the task's ratelimit option", (), {})
    e.limits.append(LimitExplanation(paced, "api", "k", 1, state))
    lines = format_explanation(e)
    pace = "     pace       burst 2, then one unit every 0.1s; the next unit conforms in 0.050s"
    assert pace in lines


def test_the_demo_report_shows_the_most_starts_in_an_interval_when_paced() -> None:
    from celery_ratelimit import Rate
    from celery_ratelimit._tools.demo import Report, ideal_drain

    rate = Rate.parse("20/2s")
    runs = [(0, 0, 0), (1_000, 0, 0), (100_000, 100_000, 1), (200_000, 200_000, 1)]
    paced = Report(4, 4, rate, 4, 4, 0.2, 0.2, 6, 2, runs, burst=2)
    assert "most starts in any 100 ms      2 (the pace: burst 2, then one every 100 ms)" in (
        paced.lines()
    )
    assert not [
        line for line in Report(4, 4, rate, 4, 4, 0.2, 0.2, 6, 2, runs).lines() if "100 ms" in line
    ]
    assert ideal_drain(60, rate, 2) == 5.8 and ideal_drain(60, rate) == 4.0


def test_the_demo_says_why_a_paced_ideal_is_longer() -> None:
    from celery_ratelimit import Rate
    from celery_ratelimit._tools.demo import Report, ideal_why

    rate = Rate.parse("20/2s")
    assert (
        ideal_why(60, rate)
        == "60 tasks at 20 per 2s fill 3 window(s): the last starts 4s after the first"
    )
    paced = ideal_why(60, rate, 2)
    assert paced.startswith(ideal_why(60, rate))
    assert "the 58 after a burst of 2 start one every 100 ms" in paced
    assert "the last starts 5.80s after the first, 1.80s later than unpaced" in paced
    assert ideal_why(60, rate, 20) == ideal_why(60, rate)  # a burst of the whole limit
    runs = [(0, 0, 0)]
    assert f"  the ideal: {paced}" in Report(60, 60, rate, 20, 20, 6.0, 5.8, 60, 0, runs, 2).lines()
