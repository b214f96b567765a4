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


@pytest.mark.parametrize(
    ("kwargs", "meant"),
    [
        ({"max_retries": 3}, "did you mean max_attempts (attempts include the first"),
        ({"timeout": 30}, "did you mean deadline"),
        ({"backoff_factor": 1}, "did you mean base_delay"),
        ({"max_attemps": 3}, "did you mean max_attempts?"),
        ({"retry_status": [503]}, "did you mean retry_statuses"),
        ({"Jitter": "full"}, "did you mean jitter"),
    ],
)
def test_an_unknown_field_names_the_field_probably_meant(kwargs: dict[str, object], meant: str) -> None:
    with pytest.raises(ValidationError, match=r"RetryPolicy has no \w+; ") as info:
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
    assert meant in str(info.value)
    assert [error["type"] for error in info.value.errors()] == ["extra_forbidden"]


def test_an_unknown_field_with_no_close_match_lists_the_fields() -> None:
    with pytest.raises(ValueError, match="RetryPolicy has no colour; its fields are max_attempts, deadline"):
        RetryPolicy(colour="blue")  # type: ignore[call-arg]


def test_every_unknown_field_is_named_and_the_presets_say_the_same() -> None:
    with pytest.raises(ValidationError, match=r"no max_retries;.*no dedline; did you mean deadline"):
        RetryPolicy(max_retries=3, dedline=5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="did you mean max_attempts"):
        RetryPolicy.interactive(max_retries=3)


def test_last_chance_without_a_start_deadline_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"last_chance .* needs a start_deadline"):
        RetryPolicy(last_chance=0.5)
    with pytest.raises(ValidationError, match="needs a start_deadline"):
        RetryPolicy.batch(last_chance=0.5)
    assert RetryPolicy(start_deadline=5, last_chance=0.5).last_chance == 0.5
    assert RetryPolicy(last_chance=0).last_chance == 0  # off needs nothing
