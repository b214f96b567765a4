"""The pure knee finder on synthetic ramps: where the knee lands, what bounds it, what it recommends."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backoff_shim.config import load_settings
from llm_backoff_shim.knee import (
    KneeInputError,
    KneeRule,
    StepStats,
    elasticity,
    find_knee,
    judge,
    recommend,
    should_stop,
)


def engine_ramp(
    levels: list[int],
    *,
    slots: int,
    ttft: float = 0.2,
    service: float = 1.0,
    batch_slowdown: float = 0.01,
    prefill_growth: float = 0.0,
) -> list[StepStats]:
    """A closed loop against an engine that runs ``slots`` requests at once and queues the rest.

    Each running request takes ``service * (1 + batch_slowdown * (running - 1))``; with more
    workers than slots every request also waits for a slot, so latency grows with the
    queue while throughput stays flat. ``prefill_growth`` makes TTFT grow with the batch.
    """
    steps = []
    for c in levels:
        running = min(c, slots)
        busy = service * (1 + batch_slowdown * (running - 1))
        latency = busy * max(1.0, c / slots)
        wait = latency - busy
        first = ttft * (1 + prefill_growth * (running - 1)) + wait
        steps.append(
            StepStats(
                concurrency=c,
                requests=100,
                errors=0,
                throughput=c / latency,
                ttft_p50=first * 0.9,
                ttft_p99=first,
                itl_p50=0.025,
                itl_p99=0.03,
                latency_p50=latency * 0.95,
                latency_p99=latency,
            )
        )
    return steps


DOUBLING = [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("slots", [2, 4, 8, 16, 32])
def test_knee_is_the_engine_capacity_when_it_is_a_measured_level(slots: int) -> None:
    knee = find_knee(engine_ramp(DOUBLING, slots=slots), KneeRule(ttft_slo=100.0))
    assert knee.step is not None
    assert knee.step.concurrency == slots
    assert knee.limit == "saturation"
    assert f"from concurrency {slots} to {slots * 2}" in knee.reason


@pytest.mark.parametrize(("slots", "expected"), [(6, 4), (12, 8), (40, 32)])
def test_knee_stays_just_under_a_capacity_between_levels(slots: int, expected: int) -> None:
    knee = find_knee(engine_ramp(DOUBLING, slots=slots), KneeRule(ttft_slo=100.0))
    assert knee.step is not None
    assert knee.step.concurrency == expected


def test_finer_levels_narrow_the_knee() -> None:
    levels = [1, 2, 4, 5, 6, 7, 8, 10, 12]
    knee = find_knee(engine_ramp(levels, slots=7), KneeRule(ttft_slo=100.0))
    assert knee.step is not None
    assert knee.step.concurrency == 7


def test_slo_bounds_the_knee_below_saturation() -> None:
    # TTFT grows with the batch (prefill contention): 0.2 s alone, 0.2 * (1 + 0.1 * 15) at 16.
    ramp = engine_ramp(DOUBLING, slots=256, batch_slowdown=0.0, prefill_growth=0.1)
    over = next(s for s in ramp if s.ttft_p99 > 0.5)
    knee = find_knee(ramp, KneeRule(ttft_slo=0.5))
    assert knee.step is not None
    assert knee.limit == "slo"
    assert knee.step.ttft_p99 <= 0.5
    assert knee.step.concurrency == over.concurrency // 2
    assert f"concurrency {over.concurrency}" in knee.reason


def test_no_saturation_in_range_recommends_the_top_level_and_says_so() -> None:
    ramp = engine_ramp([1, 2, 4, 8], slots=256)
    knee = find_knee(ramp, KneeRule(ttft_slo=10.0))
    assert knee.step is ramp[-1]
    assert knee.limit == "max_level"
    assert "raise --max-level" in knee.reason


def test_slo_missed_at_the_lowest_level_gives_no_knee() -> None:
    ramp = engine_ramp([1, 2, 4], slots=2, ttft=0.8)
    knee = find_knee(ramp, KneeRule(ttft_slo=0.5))
    assert knee.step is None
    assert knee.limit is None
    assert "over the 0.5 s SLO already at concurrency 1" in knee.reason
    with pytest.raises(KneeInputError):
        recommend(ramp[0], 0.5)


def test_failing_level_ends_the_efficient_region() -> None:
    ramp = engine_ramp([1, 2, 4, 8, 16], slots=64)
    ramp[3] = StepStats(**{**ramp[3].__dict__, "errors": 10})  # 10 of 110 failed at 8
    knee = find_knee(ramp, KneeRule(ttft_slo=10.0, max_error_ratio=0.05))
    assert knee.step is not None
    assert knee.step.concurrency == 4
    assert knee.limit == "errors"
    assert "9% of requests failed at concurrency 8" in knee.reason
    # A tolerance above the observed share lets the ramp through.
    relaxed = find_knee(ramp, KneeRule(ttft_slo=10.0, max_error_ratio=0.2))
    assert relaxed.step is not None
    assert relaxed.step.concurrency == 16


def test_every_request_failing_at_the_first_level_gives_no_knee() -> None:
    dead = StepStats(1, 0, 5, 0.0, 0, 0, 0, 0, 0, 0)
    knee = find_knee([dead], KneeRule(ttft_slo=1.0))
    assert knee.step is None
    assert knee.reason == "every request failed at concurrency 1"
    assert find_knee([], KneeRule(ttft_slo=1.0)).reason == "no step was measured"


def test_a_steep_batch_slowdown_is_a_knee_before_the_slots_fill() -> None:
    # 5 % slower per extra sequence (the simulator's default): from 16 to 32 running,
    # throughput grows 37 % while latency grows 46 %, which the rule calls past the knee.
    ramp = engine_ramp(DOUBLING, slots=32, batch_slowdown=0.05)
    knee = find_knee(ramp, KneeRule(ttft_slo=100.0))
    assert knee.step is not None
    assert knee.step.concurrency == 16
    assert knee.limit == "saturation"


def test_a_stricter_elasticity_limit_stops_earlier_on_a_soft_knee() -> None:
    # A strong batch slowdown makes throughput flatten gradually instead of at a wall.
    ramp = engine_ramp(DOUBLING, slots=128, batch_slowdown=0.3)
    loose = find_knee(ramp, KneeRule(ttft_slo=100.0, max_elasticity=1.0))
    strict = find_knee(ramp, KneeRule(ttft_slo=100.0, max_elasticity=0.5))
    assert loose.step is not None
    assert strict.step is not None
    assert strict.step.concurrency < loose.step.concurrency


def _step(c: int, throughput: float, latency: float) -> StepStats:
    return StepStats(c, 10, 0, throughput, 0.1, 0.1, 0.01, 0.01, latency, latency)


def test_elasticity_compares_log_growths() -> None:
    a = _step(1, 10.0, 1.0)
    assert elasticity(a, _step(2, 40.0, 2.0)) == pytest.approx(0.5)  # latency x2 for throughput x4
    assert elasticity(a, _step(2, 20.0, 4.0)) == pytest.approx(2.0)  # latency x4 for throughput x2
    assert elasticity(a, _step(2, 20.0, 0.9)) == 0.0  # latency fell: no cost
    assert elasticity(a, _step(2, 10.0, 1.5)) == math.inf  # latency up, throughput flat
    assert elasticity(a, _step(2, 8.0, 1.5)) == math.inf  # throughput fell
    assert elasticity(a, StepStats(2, 0, 3, 0.0, 0, 0, 0, 0, 0, 0)) == math.inf  # nothing succeeded


def test_ttft_growth_counts_above_the_noise_floor() -> None:
    a = StepStats(4, 50, 0, 10.0, 0.004, 0.005, 0.01, 0.01, 1.0, 1.0)
    # End-to-end latency x1.1 for throughput x1.5 is fine; TTFT x3 is not, unless it is jitter.
    b = StepStats(8, 50, 0, 15.0, 0.012, 0.015, 0.01, 0.01, 1.1, 1.1)
    assert elasticity(a, b, latency_floor=0.02) == pytest.approx(math.log(1.1) / math.log(1.5))
    assert elasticity(a, b, latency_floor=0.0) == pytest.approx(math.log(3) / math.log(1.5))
    assert not judge([a, b], KneeRule(ttft_slo=1.0))[1].saturated
    assert judge([a, b], KneeRule(ttft_slo=1.0, latency_floor=0.0))[1].saturated


def _measured(
    c: int, x: float, ttft: tuple[float, float, float], latency: tuple[float, float, float]
) -> StepStats:
    """A step with TTFT and latency given as (p50, p90, p99)."""
    return StepStats(
        concurrency=c,
        requests=30,
        errors=0,
        throughput=x,
        ttft_p50=ttft[0],
        ttft_p90=ttft[1],
        ttft_p99=ttft[2],
        itl_p50=0.03,
        itl_p99=0.035,
        latency_p50=latency[0],
        latency_p90=latency[1],
        latency_p99=latency[2],
    )


def test_a_lone_slow_request_is_not_a_knee() -> None:
    # Shaped like a simulator run on a busy machine: one request in 28 at concurrency 4 got
    # its first token late (p99 TTFT 0.62 s) while the p90 barely moved.
    a = _measured(2, 1.60, (0.216, 0.228, 0.234), (1.25, 1.32, 1.40))
    b = _measured(4, 2.79, (0.260, 0.275, 0.617), (1.40, 1.48, 1.74))
    rule = KneeRule(ttft_slo=1.0)
    assert not judge([a, b], rule)[1].saturated
    assert find_knee([a, b], rule).step is b
    # Without p90s the same p99 is taken at its word.
    bare = [StepStats(**{**s.__dict__, "ttft_p90": None, "latency_p90": None}) for s in (a, b)]
    assert judge(bare, rule)[1].saturated


def test_one_worker_over_the_slots_is_a_knee_though_the_median_holds() -> None:
    # 9 workers on 8 slots (simulator, --steps 6,7,8,9,10): one request in nine waits a whole
    # service time; the median TTFT barely moves, the p90 and p99 do, throughput gains 6 %.
    at8 = _measured(8, 4.91, (0.264, 0.300, 0.355), (1.62, 1.65, 1.68))
    at9 = _measured(9, 5.23, (0.273, 1.350, 1.599), (1.66, 2.70, 2.89))
    knee = find_knee([at8, at9], KneeRule(ttft_slo=3.0))
    assert knee.step is at8
    assert knee.limit == "saturation"


@pytest.mark.parametrize(
    "steps",
    [
        [_step(2, 1, 1), _step(2, 1, 1)],
        [_step(4, 1, 1), _step(2, 1, 1)],
        [_step(0, 1, 1)],
        [StepStats(1, 1, 0, math.nan, 0, 0, 0, 0, 1, 1)],
        [StepStats(1, 1, 0, 1.0, 0, -0.1, 0, 0, 1, 1)],
        [StepStats(1, -1, 0, 1.0, 0, 0, 0, 0, 1, 1)],
    ],
)
def test_bad_measurements_are_refused(steps: list[StepStats]) -> None:
    with pytest.raises(KneeInputError):
        find_knee(steps, KneeRule(ttft_slo=1.0))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttft_slo": 0.0},
        {"ttft_slo": math.inf},
        {"ttft_slo": 1.0, "max_elasticity": 0},
        {"ttft_slo": 1.0, "max_error_ratio": 1.0},
    ],
)
def test_bad_rules_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(KneeInputError):
        KneeRule(**kwargs)


def test_should_stop_once_the_last_level_is_past_the_knee() -> None:
    ramp = engine_ramp([1, 2, 4, 8], slots=4)
    rule = KneeRule(ttft_slo=100.0)
    assert [should_stop(ramp[:n], rule) for n in range(1, 5)] == [False, False, False, True]
    assert not should_stop([], rule)
    # Over the SLO also stops the ramp, even before saturation.
    slow = engine_ramp([1, 2], slots=64, prefill_growth=2.0)
    assert should_stop(slow, KneeRule(ttft_slo=0.5))
    assert [v.within_slo for v in judge(slow, KneeRule(ttft_slo=0.5))] == [True, False]


def test_recommendation_follows_the_slo_headroom() -> None:
    knee = StepStats(8, 100, 0, throughput=20.0, ttft_p50=0.1, ttft_p99=0.15, itl_p50=0.02, itl_p99=0.03,
                     latency_p50=0.4, latency_p99=0.5)  # fmt: skip
    rec = recommend(knee, 0.5)
    assert rec.max_concurrency == 8
    assert rec.max_queue_wait == pytest.approx(0.35)
    assert rec.max_queue == 7  # 20 req/s drain 7 requests in 0.35 s
    assert rec.serve_flags() == ["--max-concurrency", "8", "--max-queue", "7", "--max-queue-wait", "0.35"]


def test_recommendation_keeps_one_queue_slot_and_a_positive_wait_without_headroom() -> None:
    knee = StepStats(3, 10, 0, 2.0, 0.5, 0.5, 0.02, 0.02, 1.0, 1.0)
    rec = recommend(knee, 0.5)
    assert rec.max_queue == 1
    assert rec.max_queue_wait == 0.01


def test_recommended_flags_are_valid_shim_settings() -> None:
    knee = find_knee(engine_ramp(DOUBLING, slots=16), KneeRule(ttft_slo=2.0))
    assert knee.step is not None
    rec = recommend(knee.step, 2.0)
    shim = load_settings(rec.serve_flags())
    assert (shim.max_concurrency, shim.max_queue, shim.max_queue_wait) == (
        rec.max_concurrency,
        rec.max_queue,
        rec.max_queue_wait,
    )


@st.composite
def ramps(draw: st.DrawFn) -> list[StepStats]:
    n = draw(st.integers(1, 8))
    levels = sorted(draw(st.sets(st.integers(1, 512), min_size=n, max_size=n)))
    with_p90 = draw(st.booleans())
    steps = []
    for c in levels:
        ok = draw(st.integers(0, 200))
        ttft = draw(st.floats(0.001, 20))
        latency = ttft + draw(st.floats(0.0, 60))
        tail = draw(st.floats(0.5, 1.0)) if with_p90 else None
        steps.append(
            StepStats(
                concurrency=c,
                requests=ok,
                errors=draw(st.integers(0, 20)),
                throughput=draw(st.floats(0.01, 1000)) if ok else 0.0,
                ttft_p50=ttft / 2,
                ttft_p99=ttft,
                itl_p50=0.01,
                itl_p99=0.02,
                latency_p50=latency / 2,
                latency_p99=latency,
                ttft_p90=None if tail is None else ttft * tail,
                latency_p90=None if tail is None else latency * tail,
            )
        )
    return steps


@settings(max_examples=150, deadline=None)
@given(ramp=ramps(), slo=st.floats(0.01, 30), max_e=st.floats(0.1, 5))
def test_any_knee_meets_the_slo_and_precedes_every_saturated_level(
    ramp: list[StepStats], slo: float, max_e: float
) -> None:
    rule = KneeRule(ttft_slo=slo, max_elasticity=max_e, max_error_ratio=0.1)
    knee = find_knee(ramp, rule)
    verdicts = judge(ramp, rule)
    if knee.step is None:
        first_bad = next((i for i, v in enumerate(verdicts) if v.saturated or not v.errors_ok), len(ramp))
        assert not any(v.within_slo for v in verdicts[:first_bad])
        return
    k = ramp.index(knee.step)
    assert knee.step.ttft_p99 <= slo
    assert knee.step.requests > 0
    assert all(v.errors_ok and not v.saturated for v in verdicts[1 : k + 1])
    assert verdicts[0].errors_ok
    rec = recommend(knee.step, slo)
    assert rec.max_concurrency == knee.step.concurrency
    assert rec.max_queue >= 1
    assert rec.max_queue_wait >= 0.01
    if slo - knee.step.ttft_p99 >= 0.01:
        # Waiting the whole budget and then the knee's TTFT stays within the SLO.
        assert rec.max_queue_wait + knee.step.ttft_p99 <= slo + 1e-9
        assert rec.max_queue <= max(1, knee.step.throughput * rec.max_queue_wait + 1e-6)
