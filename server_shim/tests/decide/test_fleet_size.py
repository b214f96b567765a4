"""The fleet's size as the replicas learn it from calls refused together, and what it changes:
the spacing of the places a replica promises and the weight of each promise (fake clock)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llm_backoff_shim.decide.drain_estimate import DrainEstimator, EstimatorConfig
from llm_backoff_shim.decide.fleet_size import FleetSize
from llm_backoff_shim.decide.retry_after import HintRequest, retry_after
from llm_backoff_shim.testing import ManualClock


def test_alone_the_fleet_is_one_replica() -> None:
    assert FleetSize(ManualClock(0.0)).replicas == 1


def test_the_most_replicas_seen_within_the_window() -> None:
    clock = ManualClock(0.0)
    fleet = FleetSize(clock, window=60.0)
    fleet.observe(1)
    fleet.observe(3)
    fleet.observe(2)
    assert fleet.replicas == 3
    clock.advance(59.0)
    fleet.observe(2)
    assert fleet.replicas == 3
    clock.advance(2.0)  # the sighting of 3 is 61 s old: a replica left the fleet
    assert fleet.replicas == 2
    clock.advance(60.0)
    assert fleet.replicas == 1


def test_nonsense_is_ignored_and_the_window_must_be_positive() -> None:
    fleet = FleetSize(ManualClock(0.0))
    fleet.observe(0)
    fleet.observe(-4)
    assert fleet.replicas == 1
    with pytest.raises(ValueError, match="window"):
        FleetSize(ManualClock(0.0), window=0.0)


@given(st.lists(st.tuples(st.floats(0.0, 30.0), st.integers(-1, 6)), max_size=40), st.floats(1.0, 50.0))
def test_replicas_is_the_windowed_maximum(steps: list[tuple[float, int]], window: float) -> None:
    clock = ManualClock(0.0)
    fleet = FleetSize(clock, window=window)
    seen: list[tuple[float, int]] = []
    for gap, replicas in steps:
        clock.advance(gap)
        fleet.observe(replicas)
        if replicas >= 1:
            seen.append((clock(), replicas))
        expected = max([n for t, n in seen if t >= clock() - window], default=1)
        assert fleet.replicas == expected


def estimator(replicas: int) -> tuple[DrainEstimator, ManualClock]:
    clock = ManualClock(1000.0)
    config = EstimatorConfig(
        retry_after_min=0.5, retry_after_max=60.0, initial_service_time=1.0, return_jitter=0.0
    )
    est = DrainEstimator(config, clock)
    fleet = FleetSize(clock)
    fleet.observe(replicas)
    est.promises.fleet = fleet
    return est, clock


def test_a_replica_of_three_spaces_its_places_at_the_fleets_drain_rate() -> None:
    # One slot, 1 s a call: alone, refused callers are told 1, 2, 3 s; one of three alike
    # replicas that each place every caller the fleet refuses tells 1, 1.33, 1.67 s, and the
    # three replicas together drain three callers a second.
    alone, _ = estimator(1)
    assert [
        retry_after(alone, HintRequest("interactive", ahead=0, slots=1)) for _ in range(3)
    ] == pytest.approx([1.0, 2.0, 3.0])
    fleet, _ = estimator(3)
    assert [
        retry_after(fleet, HintRequest("interactive", ahead=0, slots=1)) for _ in range(3)
    ] == pytest.approx([1.0, 4 / 3, 5 / 3])


def test_each_promise_counts_as_its_share_of_a_return() -> None:
    est, clock = estimator(3)
    for _ in range(7):
        retry_after(est, HintRequest("interactive", ahead=0, slots=1))
    # Seven callers, each placed on all three replicas, come back to one each: 7 / 3 here.
    assert est.promises.outstanding("interactive") == 2
    assert est.promises.promised_within(("interactive",), clock(), clock() + 1.5) == 1  # 2 of 3 -> 1
    assert est.promises.promised_within(("interactive",), clock(), clock() + 1.0) == 0  # 1 of 3 -> 0


def test_a_caller_back_redeems_its_share_on_every_replica() -> None:
    est, clock = estimator(3)
    for _ in range(6):
        retry_after(est, HintRequest("interactive", ahead=0, slots=1))
    assert est.promises.outstanding("interactive") == 2
    clock.advance(1.0)
    est.promises.redeem("interactive")  # three of the six promises, the nearest, go
    assert est.promises.outstanding("interactive") == 1
    est.promises.redeem("interactive")
    assert est.promises.outstanding("interactive") == 0
    est.promises.redeem("interactive")  # nothing left: nothing happens
    assert est.promises.outstanding("interactive") == 0
