"""Returning callers (``x-stainless-retry-count`` >= 1) first: pure logic with a fake clock."""

from __future__ import annotations

import pytest

from llm_backoff_shim.admission import AdmissionRequest, parse_retry_count


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 0),
        ("0", 0),
        ("1", 1),
        (" 2 ", 2),
        ("999999", 1000),  # only ">= 1" matters; a huge claim is not kept as is
        ("", 0),
        ("-1", 0),
        ("1.5", 0),
        ("abc", 0),
        ("١", 0),  # a non-ASCII digit is malformed, not a retry
        ("12345678901234567890", 0),
    ],
)
def test_retry_count_header_is_lenient(value: str | None, expected: int) -> None:
    # A client library's header, not our protocol: unreadable means a fresh arrival, never a 400.
    assert parse_retry_count(value) == expected


def test_a_request_with_a_retry_count_is_returning() -> None:
    assert not AdmissionRequest("interactive").returning
    assert not AdmissionRequest("interactive", retry=0).returning
    assert AdmissionRequest("interactive", retry=1).returning
