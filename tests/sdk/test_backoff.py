from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llm_backoff import RetryPolicy
from llm_backoff.backoff import computed_backoff, hinted_wait, next_wait


class FixedRandom(random.Random):
    """uniform(a, b) returns the point ``fraction`` of the way from a to b."""

    def __init__(self, fraction: float) -> None:
        super().__init__(0)
        self.fraction = fraction

    def random(self) -> float:
        return self.fraction


def test_none_jitter_is_exponential_and_capped() -> None:
    p = RetryPolicy(base_delay=0.5, max_delay=30.0, jitter="none")
    rng = random.Random(1)
    assert [computed_backoff(p, n, None, rng) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_huge_retry_numbers_do_not_overflow() -> None:
    p = RetryPolicy(jitter="none")
    assert computed_backoff(p, 10_000, None, random.Random(1)) == p.max_delay


@pytest.mark.parametrize(("fraction", "expected"), [(0.0, 0.0), (0.5, 2.0), (0.999, 3.996)])
def test_full_jitter_spans_zero_to_the_capped_delay(fraction: float, expected: float) -> None:
    p = RetryPolicy(base_delay=0.5, jitter="full")
    assert computed_backoff(p, 3, None, FixedRandom(fraction)) == pytest.approx(expected)


@pytest.mark.parametrize(("fraction", "expected"), [(0.0, 2.0), (0.5, 3.0), (0.999, 3.998)])
def test_equal_jitter_keeps_half(fraction: float, expected: float) -> None:
    p = RetryPolicy(base_delay=0.5, jitter="equal")
    assert computed_backoff(p, 3, None, FixedRandom(fraction)) == pytest.approx(expected)


def test_decorrelated_jitter_grows_from_the_previous_wait_and_is_capped() -> None:
    p = RetryPolicy(base_delay=1.0, max_delay=10.0, jitter="decorrelated")
    top = FixedRandom(0.999999)
    assert computed_backoff(p, 0, None, top) == pytest.approx(3.0, rel=1e-4)  # uniform(base, base*3)
    assert computed_backoff(p, 1, 3.0, top) == pytest.approx(9.0, rel=1e-4)
    assert computed_backoff(p, 2, 9.0, top) == 10.0  # cap
    assert computed_backoff(p, 2, 9.0, FixedRandom(0.0)) == 1.0  # never below base


def test_hint_is_a_floor_with_bounded_extra() -> None:
    p = RetryPolicy(retry_after_jitter=0.2)
    assert hinted_wait(p, 5.0, FixedRandom(0.0)) == 5.0
    assert hinted_wait(p, 5.0, FixedRandom(0.5)) == pytest.approx(5.5)
    assert hinted_wait(p, 5.0, FixedRandom(0.9999)) == pytest.approx(6.0, rel=1e-3)


def test_hint_beats_max_delay_and_computed_backoff() -> None:
    p = RetryPolicy(max_delay=1.0, retry_after_jitter=0.0)
    assert next_wait(p, 0, 40.0, None, random.Random(3)) == 40.0


def test_zero_hint_falls_back_to_computed_backoff() -> None:
    p = RetryPolicy(jitter="none", base_delay=0.25)
    assert next_wait(p, 2, 0.0, None, random.Random(3)) == 1.0
    assert next_wait(p, 2, None, None, random.Random(3)) == 1.0


def test_same_hint_spreads_callers_out() -> None:
    p = RetryPolicy(retry_after_jitter=0.2)
    rng = random.Random(42)
    waits = [next_wait(p, 0, 3.0, None, rng) for _ in range(200)]
    assert min(waits) >= 3.0
    assert max(waits) <= 3.6
    assert len({round(w, 6) for w in waits}) > 150


@given(
    st.integers(min_value=0, max_value=200),
    st.sampled_from(["full", "equal", "decorrelated", "none"]),
    st.floats(min_value=0, max_value=5),
    st.floats(min_value=5, max_value=100),
    st.one_of(st.none(), st.floats(min_value=0, max_value=100)),
    st.integers(0, 2**32),
)
def test_computed_backoff_is_within_zero_and_max_delay(
    retry: int, jitter: str, base: float, cap: float, previous: float | None, seed: int
) -> None:
    p = RetryPolicy(base_delay=base, max_delay=cap, jitter=jitter)  # type: ignore[arg-type]
    wait = computed_backoff(p, retry, previous, random.Random(seed))
    assert 0.0 <= wait <= cap
