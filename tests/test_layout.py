"""The storage layout has one definition on the Python side (``_layout``): the scripts
must write what it reads, and every key name it builds must read back."""

from __future__ import annotations

import re

import pytest

from celery_ratelimit import Limit, Limiter
from celery_ratelimit._layout import (
    COUNTER_FIELDS,
    ENTRY_FLOOR,
    META_MEMBERS,
    TOKEN_LEN,
    log_entries,
    log_total,
    parse_key,
    redis_key,
)
from celery_ratelimit._scripts import source


def lua_constant(script: str, name: str) -> float:
    match = re.search(rf"^local {name} = (\S+)$", source(script), re.MULTILINE)
    assert match, f"{name} not found in lua/{script}.lua"
    return float(match.group(1))


def test_the_scripts_share_the_layouts_constants() -> None:
    assert lua_constant("sliding_log", "ENTRY_FLOOR") == ENTRY_FLOOR
    assert lua_constant("sliding_log", "TOKEN_LEN") == TOKEN_LEN
    members = ", ".join(f"'{m}'" for m in META_MEMBERS)
    assert f"redis.call('ZMSCORE', key, {members})" in source("sliding_log")
    fields = ", ".join(f"'{f}'" for f in COUNTER_FIELDS)
    assert f"redis.call('HMGET', KEYS[i], {fields})" in source("sliding_counter")


@pytest.mark.parametrize("key", ["api", "yt:quota:key1", "a%3Ab:c", "t:#0123abcd"])
@pytest.mark.parametrize("rate", ["10/s", "9500/d"])
@pytest.mark.parametrize("algorithm", ["log", "counter"])
def test_every_key_name_reads_back(key: str, rate: str, algorithm: str) -> None:
    limit = Limit(rate, algorithm=algorithm)
    name = parse_key("ratelimit", redis_key("ratelimit", key, limit))
    assert name is not None
    assert (name.key, name.algorithm, name.window_us) == (key, algorithm, limit.rate.window_us)


def test_what_the_script_writes_is_what_the_layout_reads(limiter: Limiter) -> None:
    limit = Limit("10/s")
    (key,) = limiter.keys_for("layout", limit)
    for cost in (1, 3, 2):
        assert limiter.acquire("layout", limit, cost=cost).allowed
    written = log_entries(limiter.client, key)
    assert [weight for _, weight in written] == [1, 3, 2]
    assert all(instant >= ENTRY_FLOOR for instant, _ in written)
    assert log_total(limiter.client, key) == 6
