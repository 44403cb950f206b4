"""Rate overrides (``Limiter.override``) against a real redis-server: the next decision
uses them, for the log and the counter, for reservations and starts of reserved calls;
which of a key's limits one replaces; its ttl and removal; and bad input refused by name.
Time is read from Redis ``TIME``."""

from __future__ import annotations

import time

import pytest

from celery_ratelimit import InvalidLimit, InvalidRate, Limit, Limiter
from celery_ratelimit._tools.ops import key_settings


def grants(limiter: Limiter, key: str, limits: object, n: int, cost: int = 1) -> list[bool]:
    return [limiter.acquire(key, limits, cost=cost).allowed for _ in range(n)]  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ["log", "counter"])
def test_the_next_decision_uses_a_raised_or_lowered_rate(limiter: Limiter, algorithm: str) -> None:
    limit = Limit("3/m", algorithm=algorithm)
    assert grants(limiter, "k", limit, 4) == [True] * 3 + [False]
    limiter.override("k", "5/m")
    assert grants(limiter, "k", limit, 3) == [True, True, False]
    limiter.override("k", "2/m")
    denied = limiter.acquire("k", limit)
    # the log: until the 5 just counted leave (60 s); the counter: until the estimate of
    # the next window (5 counted before it, fading) leaves room, at least 48 s from now
    assert not denied.allowed and denied.retry_after > (50 if algorithm == "log" else 45)
    limiter.override("k", None)
    assert not limiter.acquire("k", limit).allowed  # 5 counted, the declared 3/m is full


def test_an_override_of_another_window_replaces_the_keys_only_rate_limit(
    limiter: Limiter,
) -> None:
    limiter.override("k", "2/h")
    assert grants(limiter, "k", "10/s", 3) == [True, True, False]
    denied = limiter.acquire("k", "10/s")
    assert 3590 < denied.retry_after <= 3600  # the hour's window, counted in its log


def test_with_two_limits_on_a_key_an_override_replaces_the_one_of_its_window(
    limiter: Limiter,
) -> None:
    both = [Limit("5/s"), Limit("4/m")]
    limiter.override("k", "1/s")
    assert grants(limiter, "k", both, 2) == [True, False]
    assert limiter.acquire("k", both).limit == both[0]
    limiter.override("k", "1/h")  # no limit of the key has an hour's window: ignored
    time.sleep(1.05)
    assert grants(limiter, "k", both, 4) == [True] * 3 + [False]
    assert limiter.acquire("k", both).limit == both[1]


def test_an_override_applies_per_key_and_to_a_limits_own_key(limiter: Limiter) -> None:
    shared = Limit("1/m", key="shared")
    limiter.override("shared", "3/m")
    assert grants(limiter, "a", shared, 2) + grants(limiter, "b", shared, 2) == [
        True,
        True,
        True,
        False,
    ]
    assert grants(limiter, "other", "1/m", 2) == [True, False]


def test_reservations_and_starts_follow_the_override(limiter: Limiter) -> None:
    """A backlog reserved under 10/s after the rate is raised from 1/s: its slots are
    ten a second, and a reserved call starts on its slot."""
    limit = Limit("1/s")
    assert limiter.acquire("k", limit).allowed
    limiter.override("k", "10/s")
    placed = [limiter.acquire("k", limit, reserve=True) for _ in range(25)]
    assert [d.allowed for d in placed[:9]] == [True] * 9
    later = placed[9:]
    assert all(d.reserved for d in later)
    assert max(d.at for d in later) - placed[0].at < 2.1
    first = later[0]
    time.sleep(max(first.retry_after, 0))
    started = limiter.confirm(first.token, "k", limit)  # type: ignore[arg-type]
    assert started.allowed


def test_a_cost_above_the_new_limit_runs_alone_in_its_window(limiter: Limiter) -> None:
    limit = Limit("10/m")
    limiter.override("k", "2/m")
    assert limiter.acquire("k", limit, cost=5).allowed  # rather than never
    denied = limiter.acquire("k", limit)
    assert not denied.allowed and denied.retry_after > 55


def test_an_override_lapses_after_its_ttl_and_shows_until_then(limiter: Limiter) -> None:
    limiter.override("k", "1/m", ttl=3)
    (row,) = key_settings(limiter)
    assert (row.key, str(row.override)) == ("k", "1/m")
    assert row.override_for is not None and 0 < row.override_for <= 3
    assert grants(limiter, "k", "5/m", 2) == [True, False]
    time.sleep(3.1)
    assert grants(limiter, "k", "5/m", 5) == [True] * 4 + [False]
    assert key_settings(limiter) == []


def test_an_override_and_a_pause_share_the_keys_settings(limiter: Limiter) -> None:
    settings = f"{limiter.prefix}:{{k}}:settings"
    limiter.override("k", "1/s")
    assert limiter.client.pttl(settings) == -1  # an override without ttl stays
    limiter.pause("k", 1)
    assert limiter.client.pttl(settings) == -1  # a pause does not cut it short
    limiter.override("k", None)
    assert 0 < limiter.client.pttl(settings) <= 2000  # what is left is the pause
    assert limiter.acquire("k", "1/s").paused
    time.sleep(1.05)
    assert limiter.acquire("k", "1/s").allowed
    limiter.override("k", "2/s", ttl=5)
    assert 5000 < limiter.client.pttl(settings) <= 6000
    limiter.override("k", None)
    assert not limiter.client.exists(settings)


def test_a_pause_on_a_key_with_no_settings_yet_leaves_with_the_pause(limiter: Limiter) -> None:
    """Found by the soak (issue 48): a pause (an upstream's 429) created the key's
    settings hash without an expiry, taken for a lasting override's, so every key ever
    paused kept its hash for good. Now it lasts as long as the pause (plus a second)."""
    settings = f"{limiter.prefix}:{{k}}:settings"
    limiter.pause("k", 1)
    assert 1000 < limiter.client.pttl(settings) <= 2000
    limiter.override("k", "1/s", ttl=5)  # a pause and an override with a ttl: the longer
    assert 5000 < limiter.client.pttl(settings) <= 6000
    limiter.override("k", None)
    limiter.override("k", "1/s")  # a lasting override keeps it for good, pause or not
    limiter.pause("k", 1)
    assert limiter.client.pttl(settings) == -1


@pytest.mark.parametrize(
    ("key", "rate", "ttl", "error", "named"),
    [
        ("", "1/s", None, InvalidLimit, "''"),
        ("k", "10/fortnight", None, InvalidRate, "10/fortnight"),
        ("k", "0/s", None, InvalidRate, "0"),
        ("k", "1/s", 0, InvalidLimit, "0"),
        ("k", "1/s", -5, InvalidLimit, "-5"),
        ("k", "1/s", "60", TypeError, "'60'"),
    ],
)
def test_bad_overrides_are_refused_naming_the_value(
    limiter: Limiter, key: str, rate: str, ttl: object, error: type[Exception], named: str
) -> None:
    with pytest.raises(error, match=named):
        limiter.override(key, rate, ttl=ttl)  # type: ignore[arg-type]
    assert key_settings(limiter) == []
