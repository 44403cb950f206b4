"""Limit construction: every bad input fails at once, naming the bad value."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from celery_ratelimit import InvalidLimit, InvalidRate, Limit, Limiter, Rate
from celery_ratelimit._engine.limit import describe, to_limits


def test_defaults_and_label() -> None:
    limit = Limit("100/m")
    assert (limit.rate, limit.key, limit.cost, limit.algorithm) == (
        Rate(100, 60_000_000),
        None,
        1,
        "log",
    )
    assert limit.on_redis_error is None
    assert limit.label == "task@100/m"
    assert Limit("10/s", key="api:{tenant}").fields == ("tenant",)
    assert Limit("10/s", key="api:{tenant}", name="api").label == "api"
    assert describe([Limit("9500/d", key="yt:quota"), Limit("100/m", key="search")]) == (
        "yt:quota@9500/d + search@100/m"
    )


@pytest.mark.parametrize("cost", [0, -1, -100])
def test_zero_or_negative_cost_is_a_value_error(cost: int) -> None:
    with pytest.raises(InvalidLimit, match=f"got {cost}"):
        Limit("10/s", cost=cost)


@pytest.mark.parametrize("cost", [1.0, 2.5, True, False, "3", None])
def test_non_int_cost_is_a_type_error(cost: object) -> None:
    with pytest.raises(TypeError, match=repr(cost).replace(".", r"\.")):
        Limit("10/s", cost=cost)  # type: ignore[arg-type]


def test_cost_greater_than_the_limit_is_refused() -> None:
    with pytest.raises(InvalidLimit, match=r"cost 11 .*10/s"):
        Limit("10/s", cost=11)
    assert Limit("10/s", cost=10).cost == 10
    assert callable(Limit("10/s", cost=lambda *a, **k: 11).cost)  # checked per call


def test_bad_rate_in_a_limit_is_invalid_rate() -> None:
    with pytest.raises(InvalidRate, match="'10/fortnight'"):
        Limit("10/fortnight")


@pytest.mark.parametrize("algorithm", ["fixed", "LOG", "", "token_bucket"])
def test_unknown_algorithm_is_refused(algorithm: str) -> None:
    with pytest.raises(InvalidLimit, match=repr(algorithm)):
        Limit("10/s", algorithm=algorithm)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["ignore", "Defer", ""])
def test_unknown_redis_error_policy_is_refused(policy: str) -> None:
    with pytest.raises(InvalidLimit, match=repr(policy)):
        Limit("10/s", on_redis_error=policy)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "template",
    ["api:{", "api:}", "api:{}", "{user.id}", "{x!r}", "{x:>5}", "{x[0]}", "{a}{", "{ }"],
)
def test_bad_key_template_is_refused_naming_it(template: str) -> None:
    with pytest.raises(InvalidLimit) as info:
        Limit("10/s", key=template)
    assert repr(template) in str(info.value)


@pytest.mark.parametrize("key", [42, b"api", ["api"]])
def test_key_of_the_wrong_type_is_a_type_error(key: object) -> None:
    with pytest.raises(TypeError, match=repr(key).replace("[", r"\[").replace("]", r"\]")):
        Limit("10/s", key=key)  # type: ignore[arg-type]


def test_empty_key_and_empty_name_are_refused() -> None:
    with pytest.raises(InvalidLimit, match="empty"):
        Limit("10/s", key="")
    with pytest.raises(InvalidLimit, match="''"):
        Limit("10/s", name="")


def test_limit_lists_are_normalized_and_checked() -> None:
    assert to_limits("10/s") == (Limit("10/s"),)
    assert to_limits(["10/s", Limit("5/m")]) == (Limit("10/s"), Limit("5/m"))
    with pytest.raises(InvalidLimit, match="empty"):
        to_limits([])
    with pytest.raises(InvalidLimit, match=r"\['counter', 'log'\]"):
        to_limits([Limit("10/s"), Limit("5/m", algorithm="counter")])
    with pytest.raises(TypeError, match="42"):
        to_limits([Limit("10/s"), 42])
    with pytest.raises(TypeError, match="None"):
        to_limits(None)


def test_a_limit_hashes_as_it_compares_in_this_process_and_after_a_pickle() -> None:
    """Limits key the limiter's caches and hash once; the hash must not travel in a
    pickle (string hashes are seeded per process), nor may an unhashable key fail
    anything but hashing."""
    limit = Limit("10/s", key="api:{tenant}", name="api")
    assert hash(limit) == hash(Limit("10/s", key="api:{tenant}", name="api"))
    assert Limit("10/s") != Limit("10/m") and len({Limit("10/s"), Limit("10/m")}) == 2
    made_elsewhere = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pickle, sys; from celery_ratelimit import Limit; "
            "sys.stdout.buffer.write(pickle.dumps(Limit('10/s', key='api:{tenant}', name='api')))",
        ],
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        capture_output=True,
        check=True,
    ).stdout
    loaded = pickle.loads(made_elsewhere)
    assert loaded == limit and hash(loaded) == hash(limit) and loaded in {limit}

    class Key:  # a callable that compares by value and so cannot be hashed
        def __call__(self, *args: object) -> str:
            return "k"

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Key)

        __hash__ = None  # type: ignore[assignment]

    unhashable = Limit("10/s", key=Key())
    assert unhashable == Limit("10/s", key=Key())
    with pytest.raises(TypeError, match="unhashable"):
        hash(unhashable)


def test_acquire_refuses_bad_calls_before_touching_redis(limiter: Limiter) -> None:
    with pytest.raises(InvalidLimit, match="empty"):
        limiter.acquire("k", [])
    with pytest.raises(InvalidLimit, match=r"cost 11 .*10/s"):
        limiter.acquire("k", "10/s", cost=11)
    with pytest.raises(InvalidLimit, match="got 0"):
        limiter.acquire("k", "10/s", cost=0)
    for cost in (1.5, True):
        with pytest.raises(TypeError, match=repr(cost)):
            limiter.acquire("k", "10/s", cost=cost)  # type: ignore[arg-type]
    with pytest.raises(InvalidLimit, match="mixes"):
        limiter.acquire("k", [Limit("10/s"), Limit("5/m", algorithm="counter")])
    with pytest.raises(InvalidLimit, match="template"):
        limiter.acquire("k", Limit("10/s", key="api:{tenant}"))
    with pytest.raises(InvalidLimit, match="''"):
        limiter.acquire("", "10/s")
    for key in (None, 42):
        with pytest.raises(InvalidLimit, match=f"got {key}"):
            limiter.acquire(key, "10/s")  # type: ignore[arg-type]
    assert list(limiter.client.scan_iter(f"{limiter.prefix}:*")) == []


def test_a_remembered_call_shape_still_refuses_a_bool_or_float_cost(limiter: Limiter) -> None:
    # True == 1 and 1.0 == 1 hash alike: what a limiter remembers per call shape must
    # not let them through once cost=1 has been decided for the same key and limits
    assert limiter.acquire("shape", "10/s").allowed
    assert limiter.acquire("shape", [Limit("10/s"), Limit("20/m")], cost=[1, 1]).allowed
    for cost in (True, 1.0):
        with pytest.raises(TypeError, match=repr(cost)):
            limiter.acquire("shape", "10/s", cost=cost)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="True"):
        limiter.acquire("shape", [Limit("10/s"), Limit("20/m")], cost=[1, True])  # type: ignore[list-item]
    assert limiter.peek("shape", "10/s").remaining == 8
