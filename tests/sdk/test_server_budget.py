"""Reading the limits a server states in its headers: each family, and malformed values ignored."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from llm_backoff.server_budget import Limit, mentions_limits, parse_duration, parse_timestamp, read_limits

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc).timestamp()


def limits(headers: dict[str, str]) -> list[Limit]:
    lower = {k.lower(): v for k, v in headers.items()}
    return read_limits(lower.get, NOW)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1m30.5s", 90.5),
        ("1h2m3s", 3723.0),
        ("2.5", 2.5),
        (" 7s ", 7.0),
    ],
)
def test_openai_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "1x", "-1s", "1s2m", "ms", "nan", "inf", "1e309"])
def test_malformed_durations_are_none(text: str) -> None:
    assert parse_duration(text) is None


def test_openai_headers() -> None:
    found = limits(
        {
            "x-ratelimit-limit-requests": "60",
            "x-ratelimit-remaining-requests": "59",
            "x-ratelimit-reset-requests": "1s",
            "x-ratelimit-limit-tokens": "40000",
            "x-ratelimit-remaining-tokens": "38976",
            "x-ratelimit-reset-tokens": "1.536s",
        }
    )
    assert found == [
        Limit("requests", "requests", 59, 1.0, 60, refills=True),
        Limit("tokens", "tokens", 38976, pytest.approx(1.536), 40000, refills=True),
    ]


def test_anthropic_headers_reset_is_a_timestamp() -> None:
    found = limits(
        {
            "anthropic-ratelimit-requests-limit": "50",
            "anthropic-ratelimit-requests-remaining": "49",
            "anthropic-ratelimit-requests-reset": "2026-01-01T12:00:01.5Z",
            "anthropic-ratelimit-tokens-limit": "40000",
            "anthropic-ratelimit-tokens-remaining": "30000",
            "anthropic-ratelimit-tokens-reset": "2026-01-01T12:00:30+00:00",
            "anthropic-ratelimit-input-tokens-remaining": "1",
        }
    )
    assert found == [
        Limit("requests", "requests", 49, 1.5, 50, refills=True),
        Limit("tokens", "tokens", 30000, 30.0, 40000, refills=True),
    ]


def test_timestamps() -> None:
    assert parse_timestamp("2026-01-01T11:59:00Z", NOW) == 0.0  # passed
    assert parse_timestamp("2026-01-01T12:00:00", NOW) is None  # no offset: ambiguous
    assert parse_timestamp("tomorrow", NOW) is None


def test_ietf_structured_fields() -> None:
    found = limits(
        {
            "RateLimit-Policy": '"requests";q=60;w=60, "tokens";q=40000;w=60, "bytes";q=9;qu="content-bytes"',
            "RateLimit": '"requests";r=50;t=30, "tokens";r=100;t=2, "bytes";r=1;t=1',
        }
    )
    assert found == [Limit("requests", "requests", 50, 30, 60), Limit("tokens", "tokens", 100, 2, 40000)]


def test_ietf_policy_units_and_missing_policy() -> None:
    found = limits({"RateLimit": '"default";r=5;t=10, "llm";r=700;t=3;qu="tokens"'})
    assert found == [Limit("default", "requests", 5, 10, None), Limit("llm", "tokens", 700, 3, None)]


def test_ietf_early_drafts() -> None:
    assert limits(
        {"RateLimit-Limit": "100, 100;w=60", "RateLimit-Remaining": "50", "RateLimit-Reset": "30"}
    ) == [Limit("default", "requests", 50, 30, 100)]
    assert limits({"RateLimit": "limit=100, remaining=50, reset=30"}) == [
        Limit("default", "requests", 50, 30, 100)
    ]


def test_openai_wins_over_ietf_when_both_are_sent() -> None:
    found = limits(
        {
            "x-ratelimit-remaining-requests": "3",
            "RateLimit-Policy": '"requests";q=60;w=60',
            "RateLimit": '"requests";r=50;t=30',
        }
    )
    assert found == [Limit("requests", "requests", 3, None, None, refills=True)]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"x-ratelimit-remaining-requests": "lots"},
        {"x-ratelimit-remaining-requests": "-1"},
        {"anthropic-ratelimit-requests-remaining": ""},
        {"RateLimit": '"default";r=x;t=1'},
        {"RateLimit": ";;,,"},
        {"RateLimit": "limit=1, remaining=nan"},
        {"RateLimit-Remaining": "NaN"},
    ],
)
def test_malformed_or_missing_values_state_nothing(headers: dict[str, str]) -> None:
    assert limits(headers) == []


def test_malformed_reset_keeps_the_remaining() -> None:
    found = limits({"x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "soon"})
    assert found == [Limit("requests", "requests", 3, None, None, refills=True)]


def test_mentions_limits() -> None:
    assert mentions_limits(["content-type", "x-ratelimit-remaining-tokens"])
    assert mentions_limits(["ratelimit-policy"])
    assert not mentions_limits(["content-type", "retry-after", "x-request-id"])
