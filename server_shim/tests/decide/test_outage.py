"""OutageClock: the Retry-After of upstream_unavailable grows with the outage (fake clock)."""

from __future__ import annotations

import pytest

from llm_backoff_shim.decide.retry_after import OutageClock
from llm_backoff_shim.testing import ManualClock


def test_hint_is_the_outage_so_far_clamped() -> None:
    clock = ManualClock(100.0)
    outage = OutageClock(clock, minimum=1.0, maximum=30.0)
    assert outage.down_for == 0.0
    assert outage.failed() == 1.0  # a fresh failure: the minimum
    clock.now += 0.5
    assert outage.failed() == 1.0
    clock.now += 7.5
    assert outage.failed() == 8.0  # down for 8 s: come back in 8
    clock.now += 100
    assert outage.failed() == 30.0  # never past the maximum


def test_an_answer_ends_the_outage() -> None:
    clock = ManualClock(100.0)
    outage = OutageClock(clock, minimum=1.0, maximum=30.0)
    outage.failed()
    clock.now += 20
    outage.answered()
    assert outage.down_for == 0.0
    clock.now += 5
    assert outage.failed() == 1.0  # a new outage starts from the minimum


def test_a_clock_that_steps_back_never_gives_less_than_the_minimum() -> None:
    clock = ManualClock(100.0)
    outage = OutageClock(clock, minimum=2.0, maximum=30.0)
    outage.failed()
    clock.now -= 50
    assert outage.failed() == 2.0


@pytest.mark.parametrize(("minimum", "maximum"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_rejects_bad_bounds(minimum: float, maximum: float) -> None:
    with pytest.raises(ValueError, match="minimum"):
        OutageClock(ManualClock(100.0), minimum, maximum)
