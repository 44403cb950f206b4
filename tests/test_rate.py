"""Rate parsing: the accepted spellings and every malformed rate."""

from __future__ import annotations

import pytest

from celery_ratelimit import InvalidRate, Rate
from celery_ratelimit._engine.rate import MAX_LIMIT


@pytest.mark.parametrize(
    ("text", "limit", "window_us"),
    [
        ("10/s", 10, 1_000_000),
        ("100/m", 100, 60_000_000),
        ("3600/h", 3600, 3_600_000_000),
        ("9500/d", 9500, 86_400_000_000),
        ("50/10s", 50, 10_000_000),
        ("5/1.5s", 5, 1_500_000),
        ("20/300ms", 20, 300_000),
        ("1/sec", 1, 1_000_000),
        ("7/minutes", 7, 60_000_000),
        ("2/hours", 2, 3_600_000_000),
        ("3/days", 3, 86_400_000_000),
        (" 10 / 2 s ", 10, 2_000_000),
        ("4/seconds", 4, 1_000_000),
        ("6/mins", 6, 60_000_000),
        (f"{MAX_LIMIT}/d", MAX_LIMIT, 86_400_000_000),
    ],
)
def test_parses_limit_and_window_in_microseconds(text: str, limit: int, window_us: int) -> None:
    rate = Rate.parse(text)
    assert (rate.limit, rate.window_us) == (limit, window_us)
    assert rate.window == window_us / 1_000_000


@pytest.mark.parametrize(
    "text",
    [
        "",
        "10",
        "/s",
        "10/",
        "10/x",
        "10/fortnight",
        "0/s",
        "-1/s",
        "1.5/s",
        "10/0s",
        "10/0.0001ms",
        "10/0.5ms",
        "10/1.0000001s",
        "10/367d",
        f"{MAX_LIMIT + 1}/s",
        "10//s",
        "10/s/s",
        "ten/s",
        "10 per second",
        "1e3/s",
        "10/-5s",
        "10/Ms",  # not 10 per millisecond: units are lowercase
        "10/S",
        "10/mss",
        "10/ss",
        "10/hs",
        "\u0663/s",  # an Arabic-Indic 3
        "10/\uff15s",  # a fullwidth 5
    ],
)
def test_malformed_rate_raises_naming_the_text(text: str) -> None:
    with pytest.raises(InvalidRate) as info:
        Rate.parse(text)
    assert repr(text) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("value", [10, 1.5, None, b"10/s", ["10/s"]])
def test_non_string_rate_raises_naming_the_value(value: object) -> None:
    with pytest.raises(InvalidRate, match="got"):
        Rate.parse(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("limit", "window_us"),
    [(0, 1_000_000), (True, 1_000_000), (1.0, 1_000_000), (1, 999), (1, 1.5), (1, False)],
)
def test_direct_construction_is_checked(limit: object, window_us: object) -> None:
    with pytest.raises(InvalidRate):
        Rate(limit, window_us)  # type: ignore[arg-type]


def test_rate_object_parses_to_itself_and_prints_back() -> None:
    rate = Rate.parse("50/10s")
    assert Rate.parse(rate) is rate
    assert [str(Rate.parse(t)) for t in ("10/s", "100/m", "3600/h", "9500/d", "5/1.5s")] == [
        "10/s",
        "100/m",
        "3600/h",
        "9500/d",
        "5/1.5s",
    ]
    assert Rate.parse(str(Rate.parse("20/300ms"))) == Rate.parse("20/300ms")
