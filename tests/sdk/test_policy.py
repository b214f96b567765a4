from __future__ import annotations

import pytest
from pydantic import ValidationError

from llm_backoff import RetryPolicy


def test_defaults_match_the_contract() -> None:
    p = RetryPolicy()
    assert p.max_attempts == 10
    assert p.deadline == 60.0
    assert (p.base_delay, p.max_delay) == (0.5, 30.0)
    assert p.jitter == "full"
    assert p.max_retry_after == 120.0
    assert p.retry_after_jitter == 0.2
    assert p.retry_statuses == frozenset({408, 429, 500, 502, 503, 504, 529})
    assert p.retry_connection_errors is True
    assert p.retry_timeouts is True


def test_frozen_and_hashable() -> None:
    p = RetryPolicy(max_attempts=3)
    with pytest.raises(ValidationError):
        p.max_attempts = 4  # type: ignore[misc]
    assert hash(p) == hash(RetryPolicy(max_attempts=3))
    assert RetryPolicy(retry_statuses=[429, 503]).retry_statuses == frozenset({429, 503})


def test_deadline_none_is_allowed() -> None:
    assert RetryPolicy(deadline=None).deadline is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": 2.5}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
        ({"deadline": 0}, "deadline"),
        ({"deadline": -1}, "deadline"),
        ({"deadline": float("inf")}, "deadline"),
        ({"deadline": float("nan")}, "deadline"),
        ({"base_delay": -0.1}, "base_delay"),
        ({"max_delay": float("inf")}, "max_delay"),
        ({"jitter": "random"}, "jitter"),
        ({"max_retry_after": -1}, "max_retry_after"),
        ({"retry_after_jitter": 1.5}, "retry_after_jitter"),
        ({"retry_after_jitter": -0.1}, "retry_after_jitter"),
        ({"retry_statuses": [200]}, "retry_statuses"),
        ({"retry_statuses": [600]}, "retry_statuses"),
        ({"retry_timeouts": "yes"}, "retry_timeouts"),
        ({"max_retries": 3}, "max_retries"),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
    assert field in str(info.value)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_never_retry_statuses_cannot_be_enabled(status: int) -> None:
    with pytest.raises(ValidationError, match="never retried"):
        RetryPolicy(retry_statuses=[429, status])


def test_max_delay_below_base_delay_is_rejected() -> None:
    with pytest.raises(ValidationError, match="max_delay"):
        RetryPolicy(base_delay=2.0, max_delay=1.0)
