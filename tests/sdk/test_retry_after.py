from __future__ import annotations

import email.utils
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llm_backoff.retry_after import Hint, hint_from_body, parse_delay_seconds, parse_hint, parse_http_date

NOW = 1_700_000_000.0


def wall() -> float:
    return NOW


def date_in(seconds: float) -> str:
    return email.utils.formatdate(NOW + seconds, usegmt=True)


def test_retry_after_ms_wins_over_everything() -> None:
    headers = {"retry-after-ms": "2750", "retry-after": "9"}
    body = {"error": {"retry_after_seconds": 5}}
    assert parse_hint(headers, body, wall_clock=wall) == Hint(2.75, "retry-after-ms")


def test_retry_after_seconds_integer_and_float() -> None:
    assert parse_hint({"retry-after": "3"}, wall_clock=wall) == Hint(3.0, "retry-after")
    assert parse_hint({"retry-after": " 1.5 "}, wall_clock=wall) == Hint(1.5, "retry-after")


def test_retry_after_http_date_is_relative_to_the_injected_wall_clock() -> None:
    assert parse_hint({"retry-after": date_in(30)}, wall_clock=wall) == Hint(30.0, "retry-after-date")
    assert parse_hint({"retry-after": date_in(30)}, wall_clock=lambda: NOW + 10) == Hint(
        20.0, "retry-after-date"
    )


def test_past_date_and_negative_values_mean_now() -> None:
    assert parse_hint({"retry-after": date_in(-100)}, wall_clock=wall) == Hint(0.0, "retry-after-date")
    assert parse_hint({"retry-after": "-5"}, wall_clock=wall) == Hint(0.0, "retry-after")
    assert parse_hint({"retry-after-ms": "-5"}, wall_clock=wall) == Hint(0.0, "retry-after-ms")


@pytest.mark.parametrize(
    "garbage", ["soon", "", "nan", "NaN", "inf", "-inf", "1e999", "Fri, 99 Foo 2024", "3 s"]
)
def test_garbage_header_falls_through_to_the_next_source(garbage: str) -> None:
    assert parse_hint({"retry-after": garbage}, wall_clock=wall) is None
    assert parse_hint({"retry-after-ms": garbage, "retry-after": "2"}, wall_clock=wall) == Hint(
        2.0, "retry-after"
    )
    assert parse_hint({"retry-after": garbage}, b'{"retry_after_seconds": 4}', wall_clock=wall) == Hint(
        4.0, "body"
    )


def test_body_hint_inside_error_and_top_level() -> None:
    assert hint_from_body(b'{"error": {"retry_after_seconds": 2.75, "code": "queue_full"}}') == 2.75
    assert hint_from_body({"retry_after_seconds": 1}) == 1.0
    assert hint_from_body('{"retry_after_seconds": "1.5"}') == 1.5
    # the error object wins over the top level
    assert hint_from_body({"error": {"retry_after_seconds": 2}, "retry_after_seconds": 9}) == 2.0


@pytest.mark.parametrize(
    "body",
    [
        None,
        b"",
        b"<html>busy</html>",
        b"[1, 2]",
        b'{"error": "busy"}',
        b'{"retry_after_seconds": true}',
        b'{"retry_after_seconds": null}',
        b'{"retry_after_seconds": "later"}',
        b'{"retry_after_seconds": NaN}',
        b'{"retry_after_seconds": Infinity}',
        b"\xff\xfe",
    ],
)
def test_bodies_without_a_usable_hint(body: bytes | None) -> None:
    assert hint_from_body(body) is None


def test_huge_bodies_are_not_parsed() -> None:
    assert hint_from_body(b'{"retry_after_seconds": 1, "pad": "' + b"x" * 100_000 + b'"}') is None


def test_headers_mapping_is_used_as_given() -> None:
    httpx2 = pytest.importorskip("httpx2")
    headers = httpx2.Headers({"Retry-After": "7"})
    assert parse_hint(headers, wall_clock=wall) == Hint(7.0, "retry-after")


def test_helpers() -> None:
    assert parse_delay_seconds("2") == 2.0
    assert parse_delay_seconds("x") is None
    assert parse_http_date("garbage", now=NOW) is None
    assert parse_http_date(date_in(5), now=NOW) == 5.0


@given(
    st.dictionaries(
        st.sampled_from(["retry-after", "retry-after-ms", "x-other"]),
        st.text(max_size=40),
    ),
    st.one_of(st.none(), st.binary(max_size=200), st.text(max_size=200)),
)
def test_arbitrary_input_never_crashes_and_gives_a_finite_nonnegative_hint(
    headers: dict[str, str], body: bytes | str | None
) -> None:
    hint = parse_hint(headers, body, wall_clock=wall)
    if hint is not None:
        assert math.isfinite(hint.seconds)
        assert hint.seconds >= 0
