"""Property tests: the sliding log against a pure-Python model of the window, and key
escaping. Redis time cannot be steered, so the model is fed the server's own instants
(``Decision.at`` for grants and reservations, the reply's ``now`` for denials)."""

from __future__ import annotations

import itertools
import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_ratelimit import Limit, Limiter
from celery_ratelimit._engine.decision import token_bytes_of
from celery_ratelimit._engine.keys import MAX_KEY, escape_part, render
from celery_ratelimit._engine.layout import PENDING, redis_key
from celery_ratelimit._engine.scripts import ACQUIRE_FULL
from tests.calls import CONFIRM, RESERVE, RESTAMP, decide
from tests.log_reader import ENTRY_FLOOR, entries, sleep_until, total, weight_after, weight_of
from tests.measure import max_weight_in_window, us

LIMIT, WINDOW_US = 6, 120_000
RATE = Limit(f"{LIMIT}/120ms")
_examples = itertools.count()


Log = list[tuple[int, int]]  # (instant µs, weight) of each entry


def fits(log: Log, s: int, cost: int, window: int = WINDOW_US, limit: int = LIMIT) -> bool:
    """Whether ``cost`` at s fits every window (u - W, u] holding s, counting every
    entry of ``log`` (reservations included): the windows to check end at s or at an
    entry less than a window after it."""
    ends = [s] + [t for t, _ in log if s < t < s + window]
    return all(sum(w for t, w in log if u - window < t <= u) + cost <= limit for u in ends)


def first_fit(logs: list[tuple[Log, int, int]], now: int, cost: int) -> int:
    """The model of a placement: the earliest s >= now at which ``cost`` fits each of
    ``logs`` ((entries, window, limit) of each limit). Such an s is now or an instant
    some entry leaves a window (its instant + W)."""
    candidates = {now} | {t + w for log, w, _ in logs for t, _ in log if t + w > now}
    for s in sorted(candidates):
        if all(fits(log, s, cost, w, limit) for log, w, limit in logs):
            return s
    raise AssertionError("the model found no instant")  # pragma: no cover


#: The windows the script's first fit checks at most (lib/fit.lua's FIT_STEPS).
FIT_STEPS = 4


def line_end(log: Log, now: int, cost: int, window: int, limit: int) -> int:
    """The earliest s from now at which the entries of ``log`` later than s - W, every
    one of them, leave room for ``cost``: every instant from it fits."""
    return next(
        s
        for s in sorted({now} | {t + window for t, _ in log if t + window > now})
        if weight_after(log, s - window) + cost <= limit
    )


def log_fit(
    log: Log, start: int, now: int, cost: int, window: int = WINDOW_US, limit: int = LIMIT
) -> int:
    """The model of one log's placement from ``start`` (lib/log_search.lua, log_fit_at),
    as far as the script searches: it checks the window ending at s and at each entry in
    (s, s + W), going on from where one that holds too much has room, for FIT_STEPS
    windows at most; then it takes the end of the line (the earliest s from now at which
    the entries later than s - W, every one of them, leave room for ``cost``)."""
    live = [(t, w) for t, w in log if t > now - window]
    if sum(w for _, w in live) + cost <= limit:
        return start
    end = line_end(live, now, cost, window, limit)
    if end <= start or max(t for t, _ in live) <= start:
        return max(end, start)
    s = p = start
    for _ in range(FIT_STEPS):
        held = sorted((t, w) for t, w in live if p - window < t <= p)
        weight = sum(w for _, w in held)
        if weight + cost > limit:
            for t, w in held:  # the oldest leave first
                weight -= w
                if weight + cost <= limit:
                    s = p = t + window
                    break
            if s >= end:
                return end
        else:
            later = [t for t, _ in live if p < t < s + window]
            if not later:
                return s
            p = min(later)
    return end


def earliest_fit(log: Log, now: int, cost: int) -> int:
    """:func:`log_fit` from now, for the one limit ``RATE``."""
    return log_fit(log, now, now, cost)


def logs_place(logs: list[tuple[Log, int, int]], now: int, cost: int) -> int:
    """The model of a placement in several logs (lib/log_search.lua, logs_place): each
    log's :func:`log_fit` in turn until none moves the instant (at most four rounds),
    else the end of every line."""
    at, fits, asked, i, n = now, 0, 0, 0, len(logs)
    while fits < n and asked < 4 * n:
        log, window, limit = logs[i]
        i, asked = (i + 1) % n, asked + 1
        s = log_fit(log, at, now, cost, window, limit)
        at, fits = (s, 1) if s > at else (at, fits + 1)
    if fits < n:
        for log, window, limit in logs:
            at = max(at, line_end(log, now, cost, window, limit))
    return at


def uses_abandoned_room(
    grants: list[tuple[int, int]], slots: list[tuple[int, int]], now: int, cost: int
) -> bool:
    """The model of a call that does not fit counting reservations but starts at once:
    a slot in the window is overdue by more than a quarter window (abandoned: its task
    never came), and the cost fits among the entries that count for a start (what
    started, and the slots due in the last quarter window, whose tasks are on their
    way)."""
    abandoned = now - WINDOW_US // 4
    if not any(now - WINDOW_US < t <= abandoned for t, _ in slots):
        return False
    counted = [(t, w) for t, w in slots if abandoned < t <= now] + grants
    return weight_after(counted, now - WINDOW_US) + cost <= LIMIT


#: Each example runs against the real redis-server (a function-scoped fixture).
against_redis = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

operation = st.tuples(
    st.integers(1, LIMIT),  # cost
    st.integers(0, 40),  # milliseconds to wait before the call
    st.booleans(),  # reserve when denied
    # the script that decides the call: the one-limit plain script, the plain script of
    # several limits (given one), or the full one
    st.sampled_from(["acquire_one", "acquire", ACQUIRE_FULL]),
)


@pytest.mark.parametrize(
    "weight", [1, 3, 4, None], ids=["cost-1", "one-weight", "a-weight-not-dividing", "weighted"]
)
@against_redis
@given(ops=st.lists(operation, min_size=1, max_size=14))
def test_the_log_decides_like_the_model_and_never_overfills_a_window(
    limiter: Limiter,
    redis_client: redis.Redis,
    weight: int | None,
    ops: list[tuple[int, int, bool, str]],
) -> None:
    """Every call of one weight (1, 3, or 4 of 6), or of any: a plain script decides
    (acquire_one.lua, the one-limit call's, or acquire.lua, which walks several limits;
    each hands a call to acquire_full.lua where entries of another weight are stored), or
    acquire_full.lua on the same log, in any order: all three keep the one model."""
    name = f"model-{next(_examples)}"
    key = limiter.keys_for(name, RATE)[0]
    log: list[tuple[int, int]] = []
    grants: list[tuple[int, int]] = []  # what started (no reservation is ever confirmed here)
    slots: list[tuple[int, int]] = []
    plain = limiter._scripts["acquire_one"]
    for cost, wait_ms, reserve, script in ops:
        cost = weight or cost
        time.sleep(wait_ms / 1000)
        limiter._scripts["acquire_one"] = limiter._scripts[script]
        try:
            d = limiter.acquire(name, RATE, cost=cost, reserve=reserve)
        finally:
            limiter._scripts["acquire_one"] = plain
        if d.allowed:
            now = us(d.at)
            if earliest_fit(log, now, cost) != now:
                # the room of a slot whose task never came: it fits among what started
                assert uses_abandoned_room(grants, slots, now, cost), (log, now, cost)
            log.append((now, cost))
            grants.append((now, cost))
        elif d.reserved:
            slot = us(d.at)
            now = slot - us(d.retry_after)
            assert earliest_fit(log, now, cost) == slot
            assert slot > now
            log.append((slot, cost))
            slots.append((slot, cost))
        else:
            assert not reserve
            now = us(d.at)
            assert earliest_fit(log, now, cost) == now + us(d.retry_after) > now
        live = [(t, w) for t, w in log if t > now - WINDOW_US]
        assert d.remaining == max(0, LIMIT - sum(w for _, w in live))
        assert max_weight_in_window(grants, WINDOW_US) <= LIMIT
    # what Redis holds is exactly the model's entries still in the window at the last call
    stored = entries(redis_client, key)
    assert sorted(stored) == sorted(live)
    assert total(redis_client, key) == sum(w for _, w in stored)
    redis_client.delete(key)


TWO = (Limit("2/1s"), Limit("3/3s"))
line_op = st.tuples(
    st.booleans(),  # True: a new call; False: release one of the held calls
    st.integers(1, 2),  # cost of a new call
    st.integers(0, 1_000),  # which held call to release
)


@against_redis
@given(ops=st.lists(line_op, min_size=1, max_size=24))
def test_a_line_with_holes_is_placed_in_as_the_model_places_it(
    limiter: Limiter, redis_client: redis.Redis, ops: list[tuple[bool, int, int]]
) -> None:
    """Two limits on one key, calls reserved and released in any order (a line of
    reservations with holes in it): each call is placed at the earliest instant it fits
    both, counting every entry (the model's first fit), read from what Redis holds just
    before the call; no window of either log ever holds more than its limit."""
    name = f"line-{next(_examples)}"
    keys = limiter.keys_for(name, TWO)
    shape = [(limit.rate.window_us, limit.rate.limit) for limit in TWO]
    held: list[tuple[str, int]] = []
    for new, cost, pick in ops:
        if not new and held:
            token, weight = held.pop(pick % len(held))
            limiter.release(token, name, TWO, [weight, weight])
            continue
        logs = [
            (entries(redis_client, key), w, limit)
            for key, (w, limit) in zip(keys, shape, strict=True)
        ]
        d = limiter.acquire(name, TWO, [cost, cost], reserve=True)
        assert d.allowed or d.reserved, d
        at = us(d.at)
        now = at - us(d.retry_after)
        assert logs_place(logs, now, cost) == at, (logs, now, cost)
        assert first_fit(logs, now, cost) <= at  # a first fit, as far as the walk goes
        held.append((d.token, cost))  # type: ignore[arg-type]
    for key, (w, limit) in zip(keys, shape, strict=True):
        log = entries(redis_client, key)
        assert max_weight_in_window(log, w) <= limit
    redis_client.delete(*keys, *(k + PENDING for k in keys))


step = st.tuples(
    st.booleans(),  # True: a new call; False: confirm one of the reservations
    st.integers(1, LIMIT),  # cost of a new call
    st.integers(0, 30),  # milliseconds to wait before the step
    st.integers(0, 1_000),  # which reservation to confirm
)
HOLD = 0.03


@against_redis
@given(steps=st.lists(step, min_size=1, max_size=16))
def test_held_starts_never_overfill_a_window_of_starts(
    limiter: Limiter, redis_client: redis.Redis, steps: list[tuple[bool, int, int, int]]
) -> None:
    """Reservations confirmed early, on time or late, with starts held up to HOLD ahead
    (counted for that instant, no second call): the starts, immediate or held, never
    put more than the limit in any window, and every hold is within HOLD."""
    name = f"hold-{next(_examples)}"
    keys = limiter.keys_for(name, RATE)
    limits = (RATE,)
    starts: list[tuple[int, int]] = []
    pending: list[tuple[str, int]] = []  # (token, cost)
    for new, cost, wait_ms, pick in steps:
        time.sleep(wait_ms / 1000)
        if new or not pending:
            d = decide(limiter, keys, limits, cost, RESERVE, hold=HOLD)
        else:
            token, cost = pending.pop(pick % len(pending))
            d = decide(limiter, keys, limits, cost, CONFIRM, token=token, hold=HOLD)
        if d.allowed:
            assert 0 <= d.retry_after <= HOLD
            starts.append((us(d.at), cost))
        elif d.reserved:
            assert d.token is not None and d.retry_after > HOLD
            pending.append((d.token, cost))
        assert max_weight_in_window(starts, WINDOW_US) <= LIMIT, starts
    redis_client.delete(*keys, *(k + PENDING for k in keys))


# -- key escaping -------------------------------------------------------------------------

values = st.one_of(st.text(max_size=80), st.binary(max_size=80).map(bytes.hex), st.integers())


@settings(max_examples=300)
@given(a=values, b=values)
def test_distinct_argument_values_never_share_a_key_or_move_the_hash_tag(
    a: object, b: object
) -> None:
    ka = render("tenant:{x}:calls", {"x": a}, ())
    kb = render("tenant:{x}:calls", {"x": b}, ())
    assert (ka == kb) == (str(a) == str(b))
    for rendered in (ka, kb):
        full = redis_key("ratelimit", rendered, RATE)
        # the tag: the first and last segments (one slot per tenant); the key follows it
        assert full.startswith(f"ratelimit:{{tenant:calls}}:{rendered}:")
        assert full.count("{") == full.count("}") == 1
        assert rendered.count(":") == 2  # the value cannot add a segment
    ta = render("{x}:calls", {"x": a}, ())
    tb = render("{x}:calls", {"x": b}, ())
    assert (ta == tb) == (str(a) == str(b))
    tag = redis_key("ratelimit", ta, RATE).split("{", 1)[1].split("}", 1)[0]
    assert tag == f"{escape_part(a)}:calls"  # the value and the last segment


@settings(max_examples=100)
@given(value=st.one_of(st.text(min_size=100, max_size=5000), st.binary(min_size=1, max_size=5000)))
def test_long_and_binary_values_give_bounded_printable_keys(value: str | bytes) -> None:
    rendered = render("tenant:{x}:{x}:{x}", {"x": value}, ())
    assert len(rendered) <= MAX_KEY
    assert all(0x21 <= ord(c) <= 0x7E for c in rendered)
    # no value can open a brace: the only pair in the Redis name is the tag's
    assert "{" not in rendered and "}" not in rendered
    name = redis_key("ratelimit", rendered, RATE)
    assert name.startswith("ratelimit:{tenant:") and name.count("{") == name.count("}") == 1


def test_escaping_examples() -> None:
    assert escape_part("acme") == "acme"
    assert escape_part("a:b") == "a%3Ab"
    assert escape_part("{x}") == "%7Bx%7D"
    assert escape_part(b"\x00\xff") == "%00%FF"
    assert escape_part("%3A") == "%253A"  # an escaped-looking value cannot collide
    assert escape_part("x" * 65).startswith("#") and len(escape_part("x" * 65)) == 33


def model_start(
    log: dict[bytes, tuple[int, int]],
    slots: dict[bytes, int],
    own: bytes,
    t0: int,
    now: int,
    cost: int,
) -> int:
    """The model of a start (``confirm`` and ``restamp``, one limit, no guard): the earliest
    instant from ``t0`` at which ``cost`` fits among the entries later than
    ``t0 - W`` that really started: not this call's own, not a pending slot due after
    ``t0`` or overdue by more than a quarter window. A start that does not fit within
    ``HOLD`` of ``now`` and a quarter of it past ``t0`` is placed instead as a new
    reservation is: the earliest instant from ``now`` at which it fits counting every
    entry, reservations included (:func:`earliest_fit`)."""
    lo, abandoned = t0 - WINDOW_US, now - WINDOW_US // 4
    skip = {own} | {m for m, s in slots.items() if s > lo and (s <= abandoned or s > t0)}
    start = fit_among(log, skip, lo, cost, t0)
    if start - now > HOLD * 1_000_000 or start - t0 > HOLD * 1_000_000 / 4:
        others = [(s, w) for m, (s, w) in log.items() if m != own and s > now - WINDOW_US]
        start = earliest_fit(others, now, cost)
    return start


def fit_among(
    log: dict[bytes, tuple[int, int]], skip: set[bytes], lo: int, cost: int, t0: int
) -> int:
    """The earliest instant from ``t0`` at which ``cost`` fits among the entries of
    ``log`` later than ``lo`` (``t0 - W``), but those in ``skip``."""
    rows = sorted((s, w) for m, (s, w) in log.items() if s > lo and m not in skip)
    excess = sum(w for _, w in rows) + cost - LIMIT
    for s, w in rows:
        if excess <= 0:
            break
        excess -= w
        if excess <= 0:
            return s + WINDOW_US
    return t0


def read_log(
    client: redis.Redis, keys: list[str]
) -> tuple[dict[bytes, tuple[int, int]], dict[bytes, int]]:
    log = {
        m: (int(s), weight_of(m))
        for m, s in client.zrangebyscore(keys[0], ENTRY_FLOOR, "+inf", withscores=True)
    }
    slots = {m: int(s) for m, s in client.zrange(keys[0] + PENDING, 0, -1, withscores=True)}
    return log, slots


@pytest.mark.parametrize("uniform", [True, False], ids=["weights-all-1", "mixed-weights"])
@against_redis
@given(steps=st.lists(step, min_size=1, max_size=16))
def test_a_start_is_placed_as_the_model_places_it(
    limiter: Limiter,
    redis_client: redis.Redis,
    steps: list[tuple[bool, int, int, int]],
    uniform: bool,
) -> None:
    """Confirmations and restamps against the model, read from what Redis holds just
    before each call: with weights all 1 (the script counts and ranks) and mixed (it
    walks the entries)."""
    name = f"start-{next(_examples)}"
    keys = limiter.keys_for(name, RATE)
    limits = (RATE,)
    tokens: list[tuple[str, int]] = []  # (token, cost): reserved or granted calls
    for new, cost, wait_ms, pick in steps:
        if new or not tokens:
            time.sleep(wait_ms / 1000)
            # uniform: as many calls of weight 1 as the drawn cost, so as to press as hard
            for weight in [1] * cost if uniform else [cost]:
                d = decide(limiter, keys, limits, weight, RESERVE, hold=HOLD)
                if d.token is not None:
                    tokens.append((d.token, weight))
            continue
        token, cost = tokens[pick % len(tokens)]
        member = token_bytes_of(token) + (b"" if cost == 1 else b".%d" % cost)
        due = redis_client.zscore(keys[0] + PENDING, member)
        if due is None:  # a grant, restamped later
            time.sleep(wait_ms / 1000)
        else:  # a reservation, confirmed from 10 ms before its slot to 80 ms after
            sleep_until(redis_client, int(due) + wait_ms * 3000 - 10_000)
        log, slots = read_log(redis_client, keys)
        mode = CONFIRM if member in slots else RESTAMP
        d = decide(limiter, keys, limits, cost, mode, token=token, hold=HOLD)
        if not (d.allowed or d.reserved) or (mode == CONFIRM and d.token != token):
            continue  # denied, or a second start on one reservation (competes anew)
        now = us(d.at) - us(d.retry_after) if d.retry_after else us(d.at)
        slot = slots.get(member)
        if mode == CONFIRM and slot is not None and slot - now > HOLD * 1_000_000:
            assert d.reserved and us(d.at) == slot  # not due yet: left where it is
            continue
        t0 = max(now, slot) if slot is not None else now
        expected = model_start(log, slots, member, t0, now, cost)
        if d.retry_after:
            assert us(d.at) == expected, (log, slots, member, t0, now)
        else:
            assert expected <= now, (log, slots, member, t0, now)
    redis_client.delete(*keys, *(k + PENDING for k in keys))
