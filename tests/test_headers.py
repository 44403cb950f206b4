"""Reading upstreams' rate-limit headers: header sets quoted from the providers' public
documentation, and values that cannot be read (left out with one DEBUG line, never an
error)."""

from __future__ import annotations

import email.message
import email.utils
import logging

import pytest
from requests.structures import CaseInsensitiveDict

from celery_ratelimit._engine.headers import MAX_RESET, Budget, Observation, duration, parse


def at(date: str) -> float:
    return email.utils.parsedate_to_datetime(date).timestamp()


def test_github_answer_with_an_epoch_reset() -> None:
    # docs.github.com, "Rate limits for the REST API" (an answer to an exhausted quota)
    headers = {
        "Date": "Tue, 20 Aug 2013 14:50:41 GMT",
        "X-RateLimit-Limit": "60",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "1377013266",
    }
    seen = parse(headers, now=at(headers["Date"]))
    assert seen.requests == Budget(remaining=0, reset=3025.0, limit=60, early=1.0)
    assert seen.tokens is None and seen.retry_after is None


def test_delta_seconds_reset_and_retry_after() -> None:
    # docs.statbot.net, RateLimitHeaders: the reset in seconds from now
    seen = parse(
        {
            "x-ratelimit-limit": "10",
            "x-ratelimit-remaining": "5",
            "x-ratelimit-reset": "60",
            "retry-after": "30",
        },
        now=1_700_000_000.0,
    )
    assert seen == Observation(30.0, Budget(5, 60.0, 10, early=1.0))


def test_openai_requests_and_tokens() -> None:
    # platform.openai.com, "Rate limits", the sample values of the headers table
    headers = [
        ("x-ratelimit-limit-requests", "60"),
        ("x-ratelimit-limit-tokens", "150000"),
        ("x-ratelimit-remaining-requests", "59"),
        ("x-ratelimit-remaining-tokens", "149984"),
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-reset-tokens", "6m0s"),
    ]
    seen = parse(headers)
    assert seen.requests == Budget(59, 1.0, 60, early=1.0)
    assert seen.tokens == Budget(149984, 360.0, 150000, early=1.0)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("6m0s", 360.0), ("1s", 1.0), ("20ms", 0.02), ("1h2m3.5s", 3723.5), ("0.5", 0.5)],
)
def test_durations(text: str, seconds: float) -> None:
    assert duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "6m0", "m6", "1s garbage"])
def test_not_durations(text: str) -> None:
    assert duration(text) is None


def test_ietf_draft_07_dictionary_and_its_policy() -> None:
    # IETF 117 httpapi slides, "Draft-07"
    seen = parse(
        {
            "RateLimit-Policy": "100;w=60, 10000;w=86400",
            "RateLimit": "limit=100, remaining=50, reset=30",
        }
    )
    assert seen.requests == Budget(50, 30.0, 100, 60.0, 1.0)


def test_ietf_items_named_by_policy() -> None:
    # draft-ietf-httpapi-ratelimit-headers-08, "RateLimit-Policy: default;l=100;w=10"
    seen = parse({"RateLimit-Policy": "default;l=100;w=10", "RateLimit": "default;r=50;t=5"})
    assert seen.requests == Budget(50, 5.0, 100, 10.0, 1.0)


def test_ietf_several_policies_the_nearest_to_running_out_wins() -> None:
    # IETF 117 slides, "Proposal 2" (the space after ";" included); quoted names and q=
    # as the later drafts write them
    seen = parse(
        [
            ("RateLimit-Policy", "protection;l=100;w=60, quota;l=10000;w=86400"),
            ("RateLimit", "protection;r=50; t=30"),
            ("RateLimit", "quota;r=90; t=200"),
        ]
    )
    assert seen.requests == Budget(50, 30.0, 100, 60.0, 1.0)
    quoted = parse(
        {
            "RateLimit-Policy": '"burst";q=100;w=60,"daily";q=1000;w=86400',
            "RateLimit": '"burst";r=80;t=10,"daily";r=3;t=3600',
        }
    )
    assert quoted.requests == Budget(3, 3600.0, 1000, 86400.0, 1.0)


def test_ietf_policy_in_other_units_is_not_a_request_budget() -> None:
    seen = parse(
        {"RateLimit-Policy": '"bytes";q=1000;qu="content-bytes"', "RateLimit": '"bytes";r=10'}
    )
    assert seen.requests is None


def test_ietf_draft_06_trio_with_a_policy_window() -> None:
    # developers.bazaarvoice.com, "Rate Limit Headers" (the draft-06 fields)
    seen = parse(
        {
            "RateLimit-Policy": "10;w=1, 50;w=60",
            "RateLimit-Limit": "10, 10;w=1",
            "RateLimit-Remaining": "4",
            "RateLimit-Reset": "1",
        }
    )
    assert seen.requests == Budget(4, 1.0, 10, 1.0, 1.0)


def test_retry_after_as_an_http_date() -> None:
    # developer.mozilla.org, "Retry-After"
    seen = parse(
        {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, now=at("Wed, 21 Oct 2015 07:26:00 GMT")
    )
    assert seen.retry_after == 120.0
    assert not parse({"Content-Type": "text/plain"})


def test_header_objects() -> None:
    requests_like = CaseInsensitiveDict({"X-RATELIMIT-REMAINING": "3", "x-ratelimit-reset": "2"})
    assert parse(requests_like).requests == Budget(3, 2.0, early=1.0)
    message = email.message.Message()  # what urllib's response.headers is
    message["Retry-After"] = "5"
    assert parse(message).retry_after == 5.0
    with pytest.raises(TypeError, match="42"):
        parse(42)


@pytest.mark.parametrize(
    ("headers", "note"),
    [
        ({"X-RateLimit-Remaining": "-1", "X-RateLimit-Reset": "5"}, "negative"),
        ({"X-RateLimit-Remaining": "many", "X-RateLimit-Reset": "5"}, "not a number"),
        ({"X-RateLimit-Remaining": "inf", "X-RateLimit-Reset": "5"}, "not a number"),
        ({"X-RateLimit-Remaining": "1", "X-RateLimit-Reset": "soon"}, "not seconds"),
        ({"X-RateLimit-Remaining": "1", "X-RateLimit-Reset": "1000000000.5"}, "past"),
        ({"X-RateLimit-Remaining": "1"}, "come together"),
        ({"Retry-After": "later"}, "neither seconds"),
        ({"RateLimit": "default;t=5"}, "without a remaining"),
    ],
)
def test_unreadable_values_are_left_out_with_one_debug_line(
    headers: dict[str, str], note: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="celery_ratelimit"):
        seen = parse(headers, now=1_700_000_000.0)
    assert not seen
    assert len(caplog.records) == 1 and note in caplog.records[0].getMessage()


def test_far_resets_are_taken_as_a_day(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="celery_ratelimit"):
        seen = parse(
            {"X-RateLimit-Remaining": "1", "X-RateLimit-Reset": "9999999", "Retry-After": "90000"}
        )
    assert seen == Observation(MAX_RESET, Budget(1, MAX_RESET, early=1.0))
    assert len(caplog.records) == 1


def test_epoch_milliseconds() -> None:
    seen = parse({"X-RateLimit-Remaining": "7", "X-RateLimit-Reset": "1700000002500"}, now=1.7e9)
    assert seen.requests == Budget(7, 2.5)


@pytest.mark.parametrize(
    ("reset", "early"),
    [("2", 1.0), ("1700000002", 1.0), ("0.5", 0.0), ("1700000002500", 0.0), ("1m30s", 1.0)],
)
def test_a_reset_in_whole_seconds_may_come_up_to_a_second_early(reset: str, early: float) -> None:
    # an upstream that counts whole seconds rounds its reset up
    seen = parse({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset}, now=1.7e9)
    assert seen.requests is not None and seen.requests.early == early
    ms = parse({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "250ms"})
    assert ms.requests is not None and ms.requests.early == 0.0
