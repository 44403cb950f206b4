"""The limiter against a real redis-server: windows, retry-after, all-or-nothing,
reservations, expiry and script reloads. Time is steered with windows of a few hundred
milliseconds and read from Redis ``TIME``, never from the test's clock."""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from typing import Any

import pytest
import redis

from celery_ratelimit import Decision, InvalidLimit, Limit, Limiter, LimiterUnavailable
from celery_ratelimit._engine.layout import PENDING
from tests.calls import ACQUIRE, CONFIRM, RESTAMP, decide
from tests.log_reader import entries, sleep_until, total
from tests.measure import max_in_window, max_weight_in_window, server_us, us
from tests.redis_server import RedisServer, free_port


def log_key(limiter: Limiter, key: str, limit: Limit) -> str:
    return limiter.keys_for(key, [limit])[0]


def held_slot(limiter: Limiter, name: str, rate: Limit) -> Decision:
    """Spend the whole budget of ``rate`` on ``name``, then reserve the next slot."""
    for _ in range(rate.rate.limit):
        assert limiter.acquire(name, rate).allowed
    held = limiter.acquire(name, rate, reserve=True)
    assert held.reserved and held.token
    return held


# -- the window invariant ----------------------------------------------------------------


def _hammer(url: str, prefix: str, start: Any, seconds: float, out: Any) -> None:
    limiter = Limiter.from_url(url, prefix=prefix)
    timer = redis.Redis.from_url(url)
    limit = Limit("20/300ms")
    grants: list[tuple[int, int, int]] = []
    calls = 0
    start.wait()
    deadline = time.monotonic() + seconds
    first = server_us(timer)
    while time.monotonic() < deadline:
        before = server_us(timer)
        decision = limiter.acquire("shared", limit)
        after = server_us(timer)
        calls += 1
        if decision.allowed:
            grants.append((before, us(decision.at), after))
    out.put((first, server_us(timer), calls, grants))


def test_four_processes_never_put_more_than_the_limit_into_any_window(
    redis_url: str, limiter: Limiter
) -> None:
    limit, window_us, workers, seconds = 20, 300_000, 4, 1.5
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=_hammer, args=(redis_url, limiter.prefix, start, seconds, out))
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(10)
    grants = [g for _, _, _, gs in results for g in gs]
    for before, at, after in grants:
        assert before <= at <= after
    times = [at for _, at, _ in grants]
    assert len(set(times)) == len(times)  # one grant per instant: Redis runs one script at a time
    worst = max_in_window(times, window_us)
    elapsed = max(end for _, end, _, _ in results) - min(first for first, _, _, _ in results)
    ideal = limit * elapsed / window_us
    calls = sum(c for _, _, c, _ in results)
    print(f"\n{calls} calls, {len(times)} grants, ideal {ideal:.0f}, worst window {worst}")
    assert worst <= limit
    assert calls > len(times)  # the limit was contended (how often moves with load)


def test_fixed_window_lets_twice_the_limit_through_a_boundary_the_log_exactly_the_limit(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    limit, window_us = 10, 400_000
    rate = Limit(f"{limit}/400ms")
    naive_times: list[int] = []
    log_times: list[int] = []

    def burst() -> None:
        for _ in range(limit):
            now = server_us(redis_client)  # the naive limiter's clock, read in Redis too
            bucket = f"{limiter.prefix}:naive:{now // window_us}"
            if redis_client.incr(bucket) <= limit:
                naive_times.append(now)
            redis_client.pexpire(bucket, 2 * window_us // 1000)
            decision = limiter.acquire("boundary", rate)
            if decision.allowed:
                log_times.append(us(decision.at))

    for _ in range(10):  # a burst descheduled past the boundary is tried at the next one
        naive_times.clear()
        log_times.clear()
        limiter.reset("boundary", rate)
        now = server_us(redis_client)
        boundary = (now // window_us + 2) * window_us
        sleep_until(redis_client, boundary - 40_000)
        burst()
        if server_us(redis_client) < boundary:
            break
    else:
        pytest.fail("ten bursts of 10 calls each overran 40 ms")
    sleep_until(redis_client, boundary + 10_000)
    burst()

    assert len(naive_times) == 2 * limit
    assert max_in_window(naive_times, window_us) == 2 * limit
    assert len(log_times) == limit
    assert max_in_window(log_times, window_us) == limit


# -- retry-after ---------------------------------------------------------------------------


def test_retrying_at_retry_after_succeeds_and_clearly_before_is_denied(limiter: Limiter) -> None:
    rate = Limit("5/500ms")
    first = [limiter.acquire("retry", rate) for _ in range(5)]
    assert all(first)
    denied = limiter.acquire("retry", rate)
    assert not denied.allowed
    # exact: the oldest entry leaves the window W after it was granted
    assert us(denied.retry_after) == us(first[0].at) + 500_000 - us(denied.at)
    assert denied.limit == rate
    time.sleep(denied.retry_after - 0.05)
    early = limiter.acquire("retry", rate)
    slot = us(first[0].at) + 500_000
    if us(early.at) >= slot:  # the sleep overran by 50 ms (a loaded machine): it fits
        assert early.allowed
        return
    assert not early.allowed
    assert us(early.retry_after) == slot - us(early.at)
    time.sleep(early.retry_after)
    assert limiter.acquire("retry", rate).allowed


def test_weighted_retry_after_waits_for_the_kth_oldest_entry(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("8/500ms")
    key = log_key(limiter, "weighted", rate)
    for cost in (3, 1, 4):  # 50 ms apart, so that they leave the window one by one
        assert limiter.acquire("weighted", rate, cost=cost).allowed
        time.sleep(0.05)
    log = entries(redis_client, key)
    assert [w for _, w in log] == [3, 1, 4]
    assert total(redis_client, key) == 8

    denied = limiter.acquire("weighted", rate, cost=5)
    # 5 more units fit only once 3 + 1 + 4 have left: the third-oldest entry, not the oldest
    assert us(denied.retry_after) == log[2][0] + 500_000 - us(denied.at)
    small = limiter.acquire("weighted", rate, cost=3)
    # 3 units fit once the first entry (3) has left
    assert us(small.retry_after) == log[0][0] + 500_000 - us(small.at)
    assert entries(redis_client, key) == log  # denials wrote nothing

    time.sleep(small.retry_after)
    assert limiter.acquire("weighted", rate, cost=3).allowed
    early = limiter.acquire("weighted", rate, cost=4)
    if us(early.at) >= log[2][0] + 500_000:  # the sleep overran by 100 ms: it fits
        assert early.allowed
        return
    assert not early.allowed  # needs the 1 and the 4 gone, not just the oldest entry
    assert us(early.retry_after) == log[2][0] + 500_000 - us(early.at)
    time.sleep(early.retry_after)
    assert limiter.acquire("weighted", rate, cost=4).allowed


def test_a_heavy_call_costs_one_member_not_cost_members(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("1000000/s")
    key = log_key(limiter, "heavy", rate)
    decision = limiter.acquire("heavy", rate, cost=1000)
    assert decision.allowed
    assert decision.remaining == 1_000_000 - 1000
    assert entries(redis_client, key) == [(us(decision.at), 1000)]
    assert total(redis_client, key) == 1000


def test_remaining_and_reset_after_count_down(limiter: Limiter) -> None:
    rate = Limit("4/300ms")
    decisions = [limiter.acquire("count", rate) for _ in range(5)]
    assert [d.remaining for d in decisions] == [3, 2, 1, 0, 0]
    assert [d.allowed for d in decisions] == [True] * 4 + [False]
    assert us(decisions[0].reset_after) == 300_000
    # back to full once the newest entry has left
    assert us(decisions[4].reset_after) == us(decisions[3].at) + 300_000 - us(decisions[4].at)


def test_peek_answers_like_acquire_and_writes_nothing(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("2/s")
    assert limiter.peek("peek", rate).allowed
    assert redis_client.exists(log_key(limiter, "peek", rate)) == 0
    granted = limiter.acquire("peek", rate, cost=2)
    seen = limiter.peek("peek", rate)
    assert not seen.allowed
    assert us(seen.retry_after) == us(granted.at) + 1_000_000 - us(seen.at)
    assert total(redis_client, log_key(limiter, "peek", rate)) == 2


def test_reset_forgets_the_key(limiter: Limiter, redis_client: redis.Redis) -> None:
    rates = [Limit("1/s"), Limit("1/m")]
    assert limiter.acquire("reset", rates).allowed
    assert not limiter.acquire("reset", rates).allowed
    assert limiter.reset("reset", rates) == limiter.keys_for("reset", rates)
    assert limiter.acquire("reset", rates).allowed
    limiter.acquire("reset", "5/h", reserve=True)  # another window of the key
    assert len(limiter.reset("reset")) == 3  # every window and algorithm of the key
    assert limiter.reset("reset") == []


# -- several limits ------------------------------------------------------------------------


def test_a_denial_by_one_limit_consumes_nothing_from_the_others(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rates = [Limit("10/s"), Limit("3/400ms"), Limit("100/m")]
    keys = limiter.keys_for("acct", rates)
    assert len({k.split("}")[0] for k in keys}) == 1  # one hash tag for the call
    for _ in range(3):
        assert limiter.acquire("acct", rates).allowed
    before = [(total(redis_client, k), entries(redis_client, k)) for k in keys]
    assert [t for t, _ in before] == [3, 3, 3]
    denied = limiter.acquire("acct", rates, cost=1)
    assert not denied.allowed
    assert denied.limit == rates[1]
    assert [(total(redis_client, k), entries(redis_client, k)) for k in keys] == before
    heavy = limiter.acquire("acct", rates, cost=2)  # fits 10/s and 100/m, not 3/400ms
    assert not heavy.allowed and heavy.limit == rates[1]
    assert [(total(redis_client, k), entries(redis_client, k)) for k in keys] == before


def test_per_limit_costs_in_one_call(limiter: Limiter, redis_client: redis.Redis) -> None:
    rates = (Limit("100/s", key="api:units"), Limit("2/s", key="api:calls"))  # quota + cap
    keys = limiter.keys_for("api", rates)
    assert decide(limiter, keys, rates, [40, 1], ACQUIRE).allowed
    assert decide(limiter, keys, rates, [40, 1], ACQUIRE).allowed
    denied = decide(limiter, keys, rates, [10, 1], ACQUIRE)
    assert not denied.allowed and denied.limit == rates[1]
    assert [total(redis_client, k) for k in keys] == [80, 2]


def test_two_limits_on_one_redis_key_are_refused(limiter: Limiter) -> None:
    with pytest.raises(InvalidLimit, match="same Redis key"):
        limiter.acquire("api", [Limit("100/s"), Limit("2/s")])


# -- the counter -----------------------------------------------------------------------------


def test_counter_overshoot_is_bounded_and_the_log_never_overshoots(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    limit, window_us = 20, 300_000
    log, counter = Limit("20/300ms"), Limit("20/300ms", algorithm="counter")
    grants: dict[str, list[tuple[int, int]]] = {"log": [], "counter": []}
    deadline = time.monotonic() + 1.2
    calls = 0
    while time.monotonic() < deadline:
        calls += 1
        # bursts at the start of every 100 ms, then quiet: uneven traffic like cron jobs
        if server_us(redis_client) % 100_000 > 30_000:
            time.sleep(0.005)
            continue
        for name, rate in (("log", log), ("counter", counter)):
            decision = limiter.acquire("same-traffic", rate)
            if decision.allowed:
                grants[name].append((us(decision.at), 1))
    worst = {name: max_weight_in_window(g, window_us) for name, g in grants.items()}
    print(
        f"\nsame traffic, limit {limit}: grants {[len(g) for g in grants.values()]}, "
        f"worst window log {worst['log']}, counter {worst['counter']}"
    )
    assert worst["log"] <= limit
    assert worst["counter"] <= 2 * limit  # the estimate's documented worst case
    # the counter's estimate never exceeds the calls made so far, so on a new key it
    # grants the first `limit` calls as the log does (how many more it grants than the
    # log moves with the machine's pace: the benchmark's business, not a test's)
    assert len(grants["counter"]) >= min(limit, len(grants["log"]))


def test_counter_allows_the_limit_then_denies_with_its_retry_after(limiter: Limiter) -> None:
    rate = Limit("5/400ms", algorithm="counter")
    decisions = [limiter.acquire("c", rate) for _ in range(6)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False]
    assert [d.remaining for d in decisions[:5]] == [4, 3, 2, 1, 0]
    assert 0 < decisions[5].retry_after <= 0.8
    time.sleep(decisions[5].retry_after)
    assert limiter.acquire("c", rate).allowed


# -- keys, scripts, errors ---------------------------------------------------------------------


def test_idle_keys_expire_a_little_after_their_window(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    log, counter = Limit("5/300ms"), Limit("5/300ms", algorithm="counter")
    limiter.acquire("idle", log)
    limiter.acquire("idle", counter)
    log_key_, counter_key = log_key(limiter, "idle", log), log_key(limiter, "idle", counter)
    assert 300 < redis_client.pttl(log_key_) <= 300 + 1000
    assert 600 < redis_client.pttl(counter_key) <= 600 + 1000
    start = time.monotonic()
    while redis_client.exists(log_key_, counter_key) and time.monotonic() - start < 5:
        time.sleep(0.05)
    assert redis_client.exists(log_key_, counter_key) == 0
    assert time.monotonic() - start < 3  # the counter's 600 ms and a second of slack


def test_script_flush_mid_stream_reloads_the_script(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("100/m")
    allowed = 0
    for i in range(40):
        if i in (10, 25):
            redis_client.script_flush()
        allowed += limiter.acquire("flush", rate).allowed
    assert allowed == 40
    assert total(redis_client, log_key(limiter, "flush", rate)) == 40
    redis_client.script_flush()
    assert limiter.peek("flush", rate).remaining == 60


def test_a_script_flush_between_its_reload_and_its_run_loses_no_call(
    limiter: Limiter, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOSCRIPT, the script loaded again, and another client's SCRIPT FLUSH before that
    load is used (a soak's flushes met a reload once in 30 minutes, and the task failed):
    the script is loaded once more and the call decided; so is a script besides the
    decision's."""
    rate = Limit("100/m")
    assert limiter.acquire("race", rate).allowed  # checked, its scripts loaded
    load, loads = limiter.client.script_load, []

    def load_then_flush(script: str) -> str:
        sha = load(script)
        loads.append(sha)
        if len(loads) % 2:  # every other load meets the flush
            redis_client.script_flush()
        return str(sha)

    monkeypatch.setattr(limiter.client, "script_load", load_then_flush)
    for _ in range(2):
        redis_client.script_flush()
        assert limiter.acquire("race", rate).allowed
    assert total(redis_client, log_key(limiter, "race", rate)) == 3
    redis_client.script_flush()
    index, settings = f"{limiter.prefix}:index", f"{limiter.prefix}:{{race}}:settings"
    assert limiter.run_script("index", [index], ["+inf", settings]) == 1


def test_unreachable_redis_raises_limiter_unavailable() -> None:
    limiter = Limiter.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    with pytest.raises(LimiterUnavailable) as info:
        limiter.acquire("k", "1/s")
    assert isinstance(info.value.__cause__, redis.RedisError)


# -- reservations --------------------------------------------------------------------------------


def test_reservations_never_overfill_any_window(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("3/300ms")
    key = log_key(limiter, "backlog", rate)
    decisions = [limiter.acquire("backlog", rate, reserve=True) for _ in range(12)]
    assert [d.allowed for d in decisions] == [True] * 3 + [False] * 9
    assert all(d.reserved and d.token for d in decisions[3:])
    slots = [us(d.at) for d in decisions]
    # each reservation takes the slot where the entry three places before it leaves
    assert [slots[i] - slots[i - 3] for i in range(3, 12)] == [300_000] * 9
    log = entries(redis_client, key)
    assert [t for t, _ in log] == slots
    assert max_weight_in_window(log, 300_000) == 3
    assert total(redis_client, key) == 12
    assert redis_client.pttl(key) > 300 * 3  # kept until the last reservation has left


def test_a_led_grant_is_counted_later_and_the_next_window_comes_after_it(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    """``lead`` (a cold start on a green pool): a grant is counted that long after it
    is made; no window holds more than the limit, and the next window's slots are
    placed one window after the led entries, not after the grants."""
    rate, lead = Limit("3/300ms"), 0.1
    key = log_key(limiter, "led", rate)
    before = server_us(redis_client)
    led = [limiter.acquire("led", rate, lead=lead) for _ in range(3)]
    after = server_us(redis_client)
    assert all(d.allowed and d.retry_after == 0 for d in led)
    assert all(before <= us(d.at) <= after for d in led)  # answered for now
    log = entries(redis_client, key)
    assert [t for t, _ in log] == [us(d.at) + 100_000 for d in led]
    # a fourth call within the window is denied; its slot comes a window after the
    # first led entry, and no window holds more than the limit
    denied = limiter.acquire("led", rate, lead=lead, reserve=True)
    assert denied.reserved and us(denied.at) == log[0][0] + 300_000
    assert max_weight_in_window(entries(redis_client, key), 300_000) == 3
    with pytest.raises(InvalidLimit, match="lead"):
        limiter.acquire("led", rate, lead=-1.0)


def test_confirm_before_the_slot_says_not_yet_and_after_it_allows(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("2/300ms")
    held = held_slot(limiter, "confirm", rate)
    before = server_us(redis_client)
    early = limiter.confirm(held.token, "confirm", rate)
    after = server_us(redis_client)
    assert not early.allowed and early.reserved
    assert early.at == held.at
    # not yet: retry_after is the time left until the reserved slot
    assert us(held.at) - after <= us(early.retry_after) <= us(held.at) - before
    sleep_until(redis_client, us(held.at))
    before = server_us(redis_client)
    due = limiter.confirm(held.token, "confirm", rate)
    after = server_us(redis_client)
    # allowed, and its entry moved from the slot to the instant it really started
    assert due.allowed and us(held.at) <= before <= us(due.at) <= after
    # counted once, where it started; the first grant has left (its leaving was the slot),
    # the second may not have yet if the confirm came within the gap between the two
    log = entries(redis_client, log_key(limiter, "confirm", rate))
    assert log[-1] == (us(due.at), 1)
    assert us(held.at) not in [t for t, _ in log[:-1]]
    assert len(log) <= 2 and max_weight_in_window(log, 300_000) <= 2


def test_a_late_start_is_counted_where_it_happened_and_the_next_slot_waits_for_it(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("1/750ms")
    key = log_key(limiter, "late", rate)
    assert limiter.acquire("late", rate).allowed
    first = limiter.acquire("late", rate, reserve=True)  # slot at +750 ms
    second = limiter.acquire("late", rate, reserve=True)  # slot at +1500 ms
    assert us(second.at) - us(first.at) == 750_000
    # the first reserved task starts 375 ms late, the second exactly on its slot
    sleep_until(redis_client, us(first.at) + 375_000)
    late = limiter.confirm(first.token, "late", rate)
    assert late.allowed and us(late.at) >= us(first.at) + 375_000
    sleep_until(redis_client, us(second.at))
    early = limiter.confirm(second.token, "late", rate)
    # starting on its slot would put two starts within 750 ms: it must wait for the
    # late one to leave the window, and holds that instant instead
    assert not early.allowed and early.reserved
    assert us(early.at) == us(late.at) + 750_000
    sleep_until(redis_client, us(early.at))
    ok = limiter.confirm(second.token, "late", rate)
    assert ok.allowed
    assert us(ok.at) - us(late.at) >= 750_000
    assert [t for t, _ in entries(redis_client, key)] == [us(ok.at)]  # the late one has left


# Windows of a second, holds and lateness in proportion: sleep_until's wake-ups on a
# loaded machine stay well inside the margins the rules leave (a quarter of the hold,
# a quarter of the window).
HOLD = 0.75


def p_late_then_q_on_time(
    limiter: Limiter, redis_client: redis.Redis, name: str, late_us: int
) -> tuple[list[str], tuple[Limit], tuple[Decision, Decision, Decision], Decision, Decision]:
    """A key at 1/s with one grant and three reservations p, q, r after it, 1 s
    apart; p confirmed ``late_us`` after its slot, then q on its slot (hold ``HOLD``).
    Returns the keys, the limits, (p, q, r) and the two confirmations."""
    rate = Limit("1/s")
    keys, limits = limiter.keys_for(name, rate), (rate,)
    assert limiter.acquire(name, rate).allowed
    p, q, r = (limiter.acquire(name, rate, reserve=True) for _ in range(3))
    assert p.token and q.token and r.token
    assert us(q.at) - us(p.at) == us(r.at) - us(q.at) == 1_000_000
    sleep_until(redis_client, us(p.at) + late_us)
    late = decide(limiter, keys, limits, 1, CONFIRM, token=p.token, hold=HOLD)
    assert late.allowed and late.retry_after == 0  # p's own room: it starts at once
    sleep_until(redis_client, us(q.at))
    second = decide(limiter, keys, limits, 1, CONFIRM, token=q.token, hold=HOLD)
    return keys, limits, (p, q, r), late, second


def test_a_held_start_counts_for_starts_decided_before_its_instant(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    """With ``hold``, a start due within it is counted for its instant at once (no
    second call): a reservation confirmed before that instant must see it."""
    # p starts 100 ms late; q, on time, must wait for p to leave: held 100 ms (ordinary
    # jitter: at most a quarter of the hold past its slot)
    keys, limits, (_, q, r), late, held = p_late_then_q_on_time(
        limiter, redis_client, "hold", 100_000
    )
    assert held.allowed and 0 < held.retry_after <= HOLD / 4
    assert us(held.at) == us(late.at) + 1_000_000
    # r confirms early, 750 ms before its slot, while q's start is still ahead
    sleep_until(redis_client, us(r.at) - 750_000)
    early = decide(limiter, keys, limits, 1, CONFIRM, token=r.token, hold=HOLD)
    start = us(early.at)
    assert start >= us(held.at) + 1_000_000, "r would start within a window of q's start"
    assert early.reserved and early.retry_after > HOLD  # so it is deferred, not held
    # holding consumed the reservation: confirming q again is a second execution,
    # which competes anew instead of reusing it
    again = decide(limiter, keys, limits, 1, CONFIRM, token=q.token, hold=HOLD)
    assert again.token != q.token


def test_a_start_pushed_far_goes_where_a_new_reservation_would_and_moves_no_other(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    """A task that could start only well after its slot (a late one took its room)
    takes the place a new reservation would get, counting every slot, instead of the
    room that started tasks leave next: that room is the next slot's, and taking it
    would push that task, and that one the next (a chain through the backlog)."""
    # p starts 500 ms late (it goes first); q, on time, would wait 500 ms for p to
    # leave: it moves behind r instead
    keys, limits, (_, q, r), _, pushed = p_late_then_q_on_time(
        limiter, redis_client, "chain", 500_000
    )
    assert pushed.reserved and pushed.token == q.token
    assert us(pushed.at) == us(r.at) + 1_000_000
    # and r starts on its own slot, not pushed in turn
    sleep_until(redis_client, us(r.at))
    on_time = decide(limiter, keys, limits, 1, CONFIRM, token=r.token, hold=HOLD)
    assert on_time.allowed and on_time.retry_after == 0
    # q, back on its new slot, starts there
    sleep_until(redis_client, us(pushed.at))
    moved = decide(limiter, keys, limits, 1, CONFIRM, token=q.token, hold=HOLD)
    assert moved.allowed and moved.token == q.token
    assert us(moved.at) >= us(pushed.at)


def test_the_room_of_a_slot_whose_task_never_came_goes_to_a_new_call(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    """A slot overdue by more than a quarter window (its copy stuck behind a flood of
    messages, or lost) leaves its room to a call that fits among what started; the
    starts stay within the limit."""
    rate = Limit("1/s")
    limits = (rate,)
    keys = limiter.keys_for("abandoned", rate)
    assert limiter.acquire("abandoned", rate).allowed
    p, q = (limiter.acquire("abandoned", rate, reserve=True) for _ in range(2))
    assert p.token and q.token
    sleep_until(redis_client, us(p.at) + 375_000)  # p never confirms
    assert limiter.peek("abandoned", rate).allowed  # a peek says what an acquire does
    new = limiter.acquire("abandoned", rate)
    assert new.allowed and new.retry_after == 0
    # q, on time, finds that start within its window: it starts a window after it
    # (here within the hold: waited for in-process)
    sleep_until(redis_client, us(q.at))
    moved = decide(limiter, keys, limits, 1, CONFIRM, token=q.token, hold=HOLD)
    assert moved.allowed and us(moved.at) == us(new.at) + 1_000_000
    # p, arriving at last, starts a window after q at the earliest
    late = decide(limiter, keys, limits, 1, CONFIRM, token=p.token, hold=HOLD)
    assert late.reserved and us(late.at) >= us(moved.at) + 1_000_000


def test_a_grant_read_late_is_restamped_where_it_really_starts(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    """A grant whose reply was read late starts anew (``restamp``): its entry moves to the
    instant it really starts (one entry, one unit of the total, whatever the delay)."""
    rate = Limit("3/400ms")
    keys = limiter.keys_for("late", rate)
    first = limiter.acquire("late", rate)
    assert first.allowed and first.token  # every grant of the log names its entry
    others = [limiter.acquire("late", rate) for _ in range(2)]
    sleep_until(redis_client, us(first.at) + 150_000)
    for _ in range(2):  # read late twice: moved each time, never added
        moved = decide(limiter, keys, (rate,), 1, RESTAMP, token=first.token)
        assert moved.allowed and moved.retry_after == 0 and moved.token == first.token
        assert us(moved.at) >= us(first.at) + 150_000
        assert sorted(t for t, _ in entries(redis_client, keys[0])) == sorted(
            [us(d.at) for d in others] + [us(moved.at)]
        )
        assert total(redis_client, keys[0]) == 3
    # the window's room is taken by the moved start: the next slot opens when it leaves
    denied = limiter.acquire("late", rate)
    assert not denied.allowed


def test_a_grant_read_after_its_window_waits_for_the_starts_since(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    """A grant read later than a window, its entry gone and the window full of other
    starts, waits until the oldest of them leaves: a reservation, confirmed as usual."""
    rate = Limit("3/400ms")
    keys = limiter.keys_for("gone", rate)
    first = limiter.acquire("gone", rate)
    sleep_until(redis_client, us(first.at) + 450_000)
    others = [limiter.acquire("gone", rate) for _ in range(3)]  # the first one is pruned
    assert all(d.allowed for d in others)
    late = decide(limiter, keys, (rate,), 1, RESTAMP, token=first.token, hold=0.1)
    assert not late.allowed and late.reserved and late.token == first.token
    assert us(late.at) >= us(others[0].at) + 400_000
    sleep_until(redis_client, us(late.at))
    assert limiter.confirm(first.token, "gone", rate).allowed
    assert max_weight_in_window(entries(redis_client, keys[0]), 400_000) <= 3


def test_confirm_after_a_redis_restart_competes_again(
    limiter: Limiter, redis_server: RedisServer
) -> None:
    if os.environ.get("REDIS_URL"):
        pytest.skip("REDIS_URL points at a server this test must not restart")
    rate = Limit("1/300ms")
    held = held_slot(limiter, "lost", rate)
    redis_server.restart()
    again = limiter.confirm(held.token, "lost", rate)
    assert again.allowed  # the log is empty after the restart: it runs at once


def test_release_frees_a_future_reservation(limiter: Limiter, redis_client: redis.Redis) -> None:
    rate = Limit("2/400ms")
    key = log_key(limiter, "release", rate)
    assert limiter.acquire("release", rate, cost=2).allowed
    held = limiter.acquire("release", rate, reserve=True)
    assert held.reserved and held.token and total(redis_client, key) == 3
    limiter.release(held.token, "release", rate)
    assert total(redis_client, key) == 2
    assert len(entries(redis_client, key)) == 1
    again = limiter.acquire("release", rate, cost=2, reserve=True)
    assert again.reserved and again.at == held.at  # the released slot is free again


def test_no_reservation_beyond_the_horizon(limiter: Limiter, redis_client: redis.Redis) -> None:
    rate = Limit("1/400ms")
    granted = limiter.acquire("far", rate)
    assert granted.allowed
    denied = limiter.acquire("far", rate, reserve=True, horizon=0.1)
    assert not denied.allowed and not denied.reserved and denied.token is None
    assert us(denied.retry_after) == us(granted.at) + 400_000 - us(denied.at)
    assert total(redis_client, log_key(limiter, "far", rate)) == 1


def test_counter_never_reserves(limiter: Limiter) -> None:
    rate = Limit("1/400ms", algorithm="counter")
    assert limiter.acquire("c", rate, reserve=True).allowed
    denied = limiter.acquire("c", rate, reserve=True)
    assert not denied.allowed and not denied.reserved


def test_a_reservation_started_once_gives_a_second_execution_budget_of_its_own(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    rate = Limit("2/300ms")
    key = log_key(limiter, "twice", rate)
    held = held_slot(limiter, "twice", rate)
    sleep_until(redis_client, us(held.at))
    first = limiter.confirm(held.token, "twice", rate)
    assert first.allowed
    # the same message delivered again (its worker died mid-run): the log already
    # holds this token's start, so the second execution is counted as a new call
    again = limiter.confirm(held.token, "twice", rate)
    assert total(redis_client, key) >= 2
    assert again.allowed or (again.reserved and again.token != held.token)
    starts = [t for t, _ in entries(redis_client, key)]
    assert max_in_window(starts, 300_000) <= 2


def test_a_second_delivery_after_its_start_left_the_shorter_window_is_counted_anew(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    """Two limits on one key: a start's entry leaves the 1 s log before the 3 s one. A
    second delivery of the copy then is still a second execution (counted as a new
    call), not a reservation Redis lost: moving the entry the 3 s log still holds would
    leave the first execution uncounted there."""
    short, long = Limit("1/s"), Limit("5/3s")
    both = [short, long]
    assert limiter.acquire("twice", both).allowed
    held = limiter.acquire("twice", both, reserve=True)
    assert held.reserved and held.token
    sleep_until(redis_client, us(held.at))
    first = limiter.confirm(held.token, "twice", both)
    assert first.allowed
    sleep_until(redis_client, us(first.at + 1.3))  # gone from the 1 s log, not the 3 s one
    again = limiter.confirm(held.token, "twice", both)
    assert again.allowed and again.token != held.token
    key = limiter.keys_for("twice", both)[1]
    assert total(redis_client, key) == 3  # three executions, three entries
    assert max_in_window([t for t, _ in entries(redis_client, key)], 3_000_000) == 3


def _line(limiter: Limiter, name: str, rate: Limit, n: int) -> list[Decision]:
    """Spend ``rate``'s budget on ``name``, then reserve ``n`` slots behind it."""
    for _ in range(rate.rate.limit):
        assert limiter.acquire(name, rate).allowed
    line = [limiter.acquire(name, rate, reserve=True) for _ in range(n)]
    assert all(d.reserved and d.token for d in line)
    return line


def test_a_released_slot_in_a_line_of_reservations_is_taken_by_the_next_call(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    """A line of reservations with a hole at its front (two slots released): the next
    calls take the hole, the plain script's and the full script's callers alike, and a
    denial says when the hole comes; no window of the line then holds more than the
    limit."""
    rate = Limit("2/s")
    line = _line(limiter, "holed", rate, 10)  # slots 1 s, 1 s, 2 s, 2 s ... 5 s ahead
    hole = line[:2]  # 1 s ahead
    for d in hole:
        limiter.release(d.token, "holed", rate)  # type: ignore[arg-type]
    denied = limiter.acquire("holed", rate)
    assert not denied.allowed and not denied.reserved
    assert us(denied.at) + us(denied.retry_after) == us(hole[0].at)
    plain = limiter.acquire("holed", rate, reserve=True)
    assert us(plain.at) == us(hole[0].at)
    # a lead sends the call to acquire_full.lua: it places a reservation as plainly
    full = limiter.acquire("holed", rate, reserve=True, lead=0.001)
    assert us(full.at) == us(hole[1].at)
    after = limiter.acquire("holed", rate, reserve=True)
    assert us(after.at) == us(line[-2].at) + 1_000_000  # the hole is full: the line's end
    key = log_key(limiter, "holed", rate)
    assert max_in_window([t for t, _ in entries(redis_client, key)], 1_000_000) == 2


def test_a_line_of_reservations_far_ahead_leaves_the_present_free(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    """Reservations only far ahead (those before them released): a call now is granted
    now, and one that does not fit now is placed before the line, not after it."""
    rate = Limit("2/s")
    line = _line(limiter, "ahead", rate, 10)  # slots 1 s to 5 s ahead
    for d in line[:8]:
        limiter.release(d.token, "ahead", rate)  # type: ignore[arg-type]
    sleep_until(redis_client, us(line[0].at) + 50_000)  # the grants have left the window
    assert limiter.acquire("ahead", rate).allowed
    assert limiter.acquire("ahead", rate).allowed
    third = limiter.acquire("ahead", rate, reserve=True)
    assert third.reserved and third.at < line[-2].at - 2.0  # a second on, not after 5 s
    key = log_key(limiter, "ahead", rate)
    assert max_in_window([t for t, _ in entries(redis_client, key)], 1_000_000) == 2


@pytest.mark.parametrize("horizon", [600.0, 0.4], ids=["within-the-horizon", "past-it"])
def test_a_late_copy_placed_anew_takes_the_first_room_within_the_horizon(
    limiter: Limiter, redis_client: redis.Redis, horizon: float
) -> None:
    """2 per 3 s. The first slot's copy comes late and starts then; the next slot's
    copy finds no room near its slot counting what started, and is placed anew: where
    it first fits among every entry (the late start leaving, the slots after it
    released), not after the last reservation; and when that is past the horizon, it
    holds no slot (it competes again, as a new call would). A 3 s window leaves half a
    second either way to the moments the test is late by on a busy machine: the second
    copy's slot-mate abandoned, the new place within the horizon."""
    rate = Limit("2/3s")
    line = _line(limiter, "late", rate, 10)  # slots 3, 3, 6, 6, ... 15 s ahead
    first, second = line[0], line[2]  # due 3 s and 6 s ahead
    for d in line[4:6]:  # due 9 s ahead
        limiter.release(d.token, "late", rate)  # type: ignore[arg-type]
    sleep_until(redis_client, us(first.at + 0.9))  # late by more than a quarter window
    late = limiter.confirm(first.token, "late", rate)  # type: ignore[arg-type]
    assert late.allowed  # its slot's partner never came: room among what started
    sleep_until(redis_client, us(second.at))
    moved = limiter.confirm(second.token, "late", rate, horizon=horizon)  # type: ignore[arg-type]
    key = log_key(limiter, "late", rate)
    # when the late start leaves its window (not after the line's end, 18 s ahead)
    due = us(late.at) + 3_000_000
    if horizon > 1:
        assert moved.reserved and moved.token == second.token
        assert us(moved.at) == due, (moved.at - second.at, late.at - second.at)
    else:
        assert not moved.allowed and not moved.reserved
        assert us(moved.at) + us(moved.retry_after) == due
        member = bytes.fromhex(second.token)  # type: ignore[arg-type]
        assert redis_client.zscore(key, member) is None
        assert redis_client.zscore(key + PENDING, member) is None
    assert max_in_window([t for t, _ in entries(redis_client, key)], 3_000_000) <= 2


@pytest.mark.parametrize(
    "token",
    ["zz", "ab", "", None, 42, "0123456789abcdeg", "0" * 18, "0123456789abcdef.", "0" * 16 + ".x"],
)
def test_a_token_the_limiter_did_not_write_is_refused_naming_it(
    limiter: Limiter, token: object
) -> None:
    for call in (limiter.confirm, limiter.release):
        with pytest.raises(
            InvalidLimit, match=r"not a reservation token: " + re.escape(repr(token))
        ):
            call(token, "k", "2/s")  # type: ignore[arg-type]
    assert limiter.peek("k", "2/s").remaining == 2  # nothing was counted or reserved


@pytest.mark.parametrize("horizon", [float("nan"), float("inf"), 0, -1.0, 10**9])
def test_a_horizon_that_is_no_span_of_time_is_refused_naming_it(
    limiter: Limiter, horizon: float
) -> None:
    with pytest.raises(InvalidLimit, match=r"horizon must be .* got " + re.escape(repr(horizon))):
        limiter.acquire("k", "2/s", reserve=True, horizon=horizon)
    with pytest.raises(TypeError, match="horizon"):
        limiter.acquire("k", "2/s", reserve=True, horizon="60")  # type: ignore[arg-type]


@pytest.mark.parametrize("newer", [False, True], ids=["whole-log-left", "one-newer-entry"])
def test_a_burst_leaving_a_long_log_is_pruned_a_batch_per_call(
    limiter: Limiter, redis_client: redis.Redis, newer: bool
) -> None:
    """1,200 entries leaving the window together are removed 500 per call (no call
    removes a whole burst at once), while every decision still counts only the
    window, and the stored total always equals the stored entries' weight."""
    rate = Limit("3000/400ms")
    key = f"burst-{newer}"
    keys = limiter.keys_for(key, rate)
    # a burst granted within a millisecond, written as the script writes it (one grant
    # by the script, then 1,199 more entries a microsecond apart before it, and the
    # running total): however slowly this machine would send 1,200 calls, they all
    # leave the window together
    first = limiter.acquire(key, rate)
    last = us(first.at)
    redis_client.zadd(keys[0], {os.urandom(8): last - 1 - i for i in range(1199)})
    redis_client.zadd(keys[0], {"": 1200})
    assert total(redis_client, keys[0]) == len(entries(redis_client, keys[0])) == 1200
    if newer:
        sleep_until(redis_client, last + 200_000)
        assert limiter.acquire(key, rate).allowed
    sleep_until(redis_client, last + 401_000)  # the whole burst has left the window
    stored = []
    for _ in range(3):
        d = limiter.acquire(key, rate)
        assert d.allowed
        live = [t for t, _ in entries(redis_client, keys[0]) if t > us(d.at) - 400_000]
        assert d.remaining == 3000 - len(live)
        stored.append(len(entries(redis_client, keys[0])))
        assert total(redis_client, keys[0]) == stored[-1]
    extra = 1 if newer else 0
    assert stored == [701 + extra, 202 + extra, 3 + extra]


@pytest.mark.parametrize(
    ("rate", "guard", "window_us", "slack_us"),
    [
        ("2/700ms", 0.03, 700_000, 28_000),
        ("2/2s", 0.03, 2_000_000, 30_000),
        ("2/2s", 0.0, 2_000_000, 0),
    ],
    ids=["capped-at-4%-of-700ms", "30ms-of-2s", "none"],
)
def test_the_guard_widens_a_windows_placement_by_at_most_4_percent_of_it(
    limiter: Limiter, rate: str, guard: float, window_us: int, slack_us: int
) -> None:
    """``ratelimit_guard``: slots are placed in windows ``guard`` wider, at most 4% of
    the window: a call denied after two grants may go when the first grant has left a
    window that much wider than the limit's."""
    limit = Limit(rate)
    first = limiter.acquire("g", limit, guard=guard)
    assert first.allowed and limiter.acquire("g", limit, guard=guard).allowed
    denied = limiter.acquire("g", limit, guard=guard, reserve=True)
    assert denied.reserved
    assert us(denied.at) - us(first.at) == window_us + slack_us
