"""Calibrate's planning and one level's steady-window statistics, pure: no server, no sleeping.

Traces are built on a clock of our own (closed loops of workers whose requests last a given
time), so the tests say exactly what each figure must be.
"""

from __future__ import annotations

import itertools
import math

import pytest

from llm_backoff_shim.lab.calibrate.measure import (
    CostMeter,
    Sample,
    SlotCost,
    StepStats,
    budget_tokens,
    cost_quantile,
    slot_cost,
    summarize,
    tokens_in,
)
from llm_backoff_shim.lab.calibrate.run import (
    COARSE,
    Sizing,
    expected_duration,
    measurement_seconds,
    plan_lines,
    plan_sweep,
    thin,
    time_to_go,
)
from llm_backoff_shim.testing import ManualClock

# -- step sizing --------------------------------------------------------------------------


def test_a_level_counts_two_completions_per_slot_at_least_twenty_at_most_six_durations() -> None:
    sizing = Sizing()
    assert [sizing.completions(c) for c in (1, 2, 3, 4, 8, 10, 16, 64)] == [6, 12, 18, 20, 20, 20, 32, 128]
    # In request durations: six at the lowest levels, two per slot from ten workers up.
    assert [sizing.window_durations(c) for c in (1, 2, 4, 16, 64)] == [6, 6, 5, 2, 2]
    assert Sizing(cap=25).completions(64) == 25
    assert [COARSE.completions(c) for c in (1, 4, 16)] == [3, 10, 16]


def test_a_measurement_lasts_a_ramp_in_and_its_window_in_request_durations() -> None:
    sizing = Sizing(min_seconds=3.0)
    # The slow engine: 13 s a request at 14 workers: ramp-in 13 s, then 28 completions = 2 durations.
    assert measurement_seconds(sizing, 14, 13.0) == pytest.approx(13 + 26)
    assert measurement_seconds(sizing, 14, 13.0, turnover=False) == pytest.approx(26)
    # At concurrency 1 six requests, not twenty.
    assert measurement_seconds(sizing, 1, 4.5) == pytest.approx(4.5 + 6 * 4.5)
    # A fast engine's window is held to --step-seconds.
    assert measurement_seconds(sizing, 8, 0.2) == pytest.approx(0.2 + 3.0)


def test_the_requests_expected_at_a_level_follow_what_was_measured() -> None:
    def step(level: int, latency: float, rate: float) -> StepStats:
        return StepStats(level, 20, 0, rate, 0.1, 0.2, 0.01, 0.02, latency, latency, mean_latency=latency)

    assert expected_duration(4, 4.5, {}) == 4.5  # only the probe so far
    runs = {1: [step(1, 4.5, 0.22)], 8: [step(8, 9.0, 0.9)]}
    assert expected_duration(4, 4.5, runs) == 4.5
    assert expected_duration(16, 4.5, runs) == pytest.approx(16 / 0.9)  # Little: at least level / best rate
    assert expected_duration(8, 4.5, runs) == 9.0


def test_the_time_to_go_is_re_estimated_from_what_was_measured() -> None:
    sizing = Sizing(min_seconds=0)

    def step(level: int, latency: float, rate: float) -> StepStats:
        return StepStats(level, 20, 0, rate, 0.1, 0.2, 0.01, 0.02, latency, latency, mean_latency=latency)

    # Nothing measured: every level and the settling at the probe's pace.
    assert time_to_go((1, 2), 2, sizing, 1.0, {}) == pytest.approx(7 + 7 + 3 * 7)
    # Level 1 measured 2 s a request, 0.5 req/s: two workers take at least 2 / 0.5 = 4 s a request.
    runs = {1: [step(1, 2.0, 0.5)]}
    assert time_to_go((1, 2), 2, sizing, 1.0, runs) == pytest.approx(4 * 7 * 4.0)
    # At the pace measured (the engine not full yet), 2 s a request.
    assert time_to_go((1, 2), 2, sizing, 1.0, runs, full=False) == pytest.approx(4 * 7 * 2.0)
    # Once the climb is over only the settling measurements not yet taken remain.
    assert time_to_go((1, 2, 4), 2, sizing, 1.0, runs, settled=1) == pytest.approx(2 * 7 * 2.0)
    assert time_to_go((1, 2, 4), 2, sizing, 1.0, runs, settled=5) == 0.0


# -- the plan against --max-seconds --------------------------------------------------------------

RAMP = (1, 2, 4, 8, 16, 32, 64)


def test_a_plan_that_fits_is_run_whole() -> None:
    plan = plan_sweep(RAMP, 4, Sizing(), 1.0, 600)
    assert (plan.levels, plan.repeats, plan.sizing, plan.cuts, plan.fits) == (RAMP, 4, Sizing(), (), True)
    # 7 levels climbed (7+7+6+3+3+3+3 durations, the 3 s floor aside) and 5 settling at the top's cost.
    assert plan.seconds == pytest.approx(plan.full_seconds)
    lines = plan_lines(plan, "probe text")
    assert lines[0].startswith("plan: probe text; each level waits for one request per slot to end")
    assert lines[-1] == "plan: within the 10 min --max-seconds leaves"


def test_a_plan_over_max_seconds_cuts_steps_then_repeats_then_levels() -> None:
    duration = 13.0  # the slow engine
    full = plan_sweep(RAMP, 4, Sizing(), duration, 1e9)
    coarser = plan_sweep(RAMP, 4, Sizing(), duration, full.seconds * 0.8)
    assert coarser.sizing == COARSE
    assert (coarser.levels, coarser.repeats) == (RAMP, 4)
    assert coarser.fits
    assert coarser.seconds <= full.seconds * 0.8
    fewer_repeats = plan_sweep(RAMP, 4, Sizing(), duration, coarser.seconds - 1)
    assert (fewer_repeats.sizing, fewer_repeats.repeats, fewer_repeats.levels) == (COARSE, 2, RAMP)
    thinned = plan_sweep(RAMP, 4, Sizing(), duration, fewer_repeats.seconds - 1)
    assert thinned.levels == (1, 4, 16, 64)
    assert thinned.fits
    assert [cut.split(" (")[0] for cut in thinned.cuts] == [
        "coarser steps",
        "2 measurements per level next to the knee",
        "fewer levels",
    ]
    lines = plan_lines(thinned, "p")
    assert any("--max-seconds leaves: cut to coarser steps" in line for line in lines)
    # Nothing left to cut: said, and the sweep will stop where the time runs out.
    hopeless = plan_sweep(RAMP, 4, Sizing(), duration, 60)
    assert not hopeless.fits
    assert hopeless.levels == (1, 64)
    assert "the sweep stops when the next measurement does not fit" in plan_lines(hopeless, "p")[-1]


def test_thinning_keeps_the_ends() -> None:
    assert thin((1, 2, 4, 8, 16)) == (1, 4, 16)
    assert thin((1, 2, 4, 8)) == (1, 4, 8)
    assert thin((3,)) == (3,)


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ValueError, match="no level"):
        plan_sweep((), 2, Sizing(), 1.0, 10)
    with pytest.raises(ValueError, match="duration"):
        plan_sweep(RAMP, 2, Sizing(), 0.0, 10)
    with pytest.raises(ValueError, match="per_slot"):
        Sizing(per_slot=0)


# -- one level's window ------------------------------------------------------------------------


def closed_loop(
    level: int, durations: list[float], start: float, end: float, carried: list[float]
) -> list[Sample]:
    """A closed loop of ``level`` workers from ``start`` until ``end`` on our own clock.

    Worker ``i`` first finishes the request carried in from the level before (ending at
    ``carried[i]``; none for a new worker, which starts at ``start``), then sends requests
    one after the other, their durations taken in turn from ``durations``; one token per
    0.1 s of each request after its first 0.2 s, cost 100 + 10 per second of duration.
    Requests still running at ``end`` are returned as running (``done`` False).
    """
    lengths = itertools.cycle(durations)
    samples: list[Sample] = []
    for worker in range(level):
        t, seq = start, 0
        if worker < len(carried):
            # The carried request started a duration before its end, at the level before.
            d = next(lengths)
            samples.append(_request(worker, -1, carried[worker] - d, d, end))
            t = carried[worker]
        while t < end:
            d = next(lengths)
            samples.append(_request(worker, seq, t, d, end))
            t += d
            seq += 1
    return samples


def _request(worker: int, seq: int, start: float, duration: float, now: float) -> Sample:
    ticks = [start + 0.2 + 0.1 * k for k in range(int((duration - 0.2) / 0.1) + 1)]
    done = start + duration <= now
    seen = tuple(t for t in ticks if t <= now)
    return Sample(
        worker,
        seq,
        start,
        start + duration if done else now,
        True,
        first_token=ticks[0] if seen else None,
        itl=0.1,
        output_tokens=len(seen),
        cost=100 + int(10 * duration),
        token_times=seen,
        done=done,
    )


def test_a_level_whose_requests_outlast_its_window_is_measured_from_completions() -> None:
    # The slow GPU box: about 13 s a request at 12 and at 14 workers. Fixed 6 s steps read
    # 4.41 req/s at 14 beside 0.84 at 12; counted in a steady window, both are the engine's
    # rate, workers over the request duration.
    durations = [9.0, 13.0, 17.0, 11.0, 15.0]
    mean = sum(durations) / len(durations)
    rates = {}
    for level, carried_in in ((12, 8), (14, 12)):
        # Requests of the level before are still running when the level starts at t=100.
        carried = [100 + 1.3 * i for i in range(carried_in)]
        samples = closed_loop(level, durations, 100.0, 200.0, carried)
        # The ramp-in ends at the level-th completion after the start; the window counts 2 per slot.
        ends = sorted(s.end for s in samples if s.done and s.end > 100)
        low = ends[level - 1]
        high = ends[level - 1 + 2 * level]
        inside = [s for s in samples if s.end > low and s.start < high]
        stats = summarize(level, inside, level_start=100.0, window=(low, high))
        rates[level] = stats.throughput
        assert stats.throughput == pytest.approx(level / mean, rel=0.15)
        assert stats.requests == 2 * level
        # Latency figures leave out the carried-in requests and each worker's first one.
        assert stats.latency_p50 == pytest.approx(13.0, abs=2.0)
        # Tokens: 10 a second per worker, minus each request's 0.2 s before its first token.
        assert stats.output_tokens_per_s == pytest.approx(level * 10 * (1 - 0.2 / mean), rel=0.1)
        # The cost in flight is time-weighted: a long request weighs by how long it runs.
        weighted = sum((100 + int(10 * d)) * d for d in durations) / sum(durations)
        assert stats.inflight_cost == pytest.approx(level * weighted, rel=0.05)
    assert rates[14] / rates[12] == pytest.approx(14 / 12, rel=0.2)


def test_the_window_leaves_the_ramp_in_out() -> None:
    # A level of 2 starting at t=10: both workers' first requests (the burst) are slow.
    burst = [Sample(w, 0, 10.0, 14.0, True, first_token=13.0, output_tokens=10, cost=50) for w in (0, 1)]
    steady = [
        Sample(w, k, 14.0 + k - 1, 15.0 + k - 1, True, first_token=14.1 + k - 1, output_tokens=10, cost=50)
        for w in (0, 1)
        for k in (1, 2, 3)
    ]
    window = (14.0, 17.0)
    stats = summarize(2, burst + steady, level_start=10.0, window=window)
    # Completions ending in (14, 17]: three per worker; the burst ended at 14, outside.
    assert stats.requests == 6
    assert stats.throughput == pytest.approx(6 / 3)
    assert stats.ttft_p99 == pytest.approx(0.1)  # the burst's 3 s TTFT is not judged
    assert stats.errors == 0


def test_running_requests_count_their_tokens_and_cost_but_not_as_completions() -> None:
    running = Sample(
        0, 3, 9.0, 12.0, True, token_times=(10.5, 11.0, 11.5), output_tokens=3, cost=300, done=False
    )
    ended = Sample(1, 3, 9.0, 11.0, True, first_token=9.5, token_times=(9.5, 10.5), output_tokens=2, cost=100)
    stats = summarize(2, [running, ended], level_start=0.0, window=(10.0, 12.0))
    assert stats.requests == 1
    assert stats.output_tokens_per_s == pytest.approx((3 + 1) / 2.0)
    assert stats.inflight_cost == pytest.approx((300 * 2 + 100 * 1) / 2.0)
    # Both together (400) for half the window, the running one alone (300) for the other half.
    assert stats.inflight_cost_high == 400
    # Usage counted 4 tokens over 2 chunks: each chunk weighs 2.
    assert tokens_in(Sample(0, 0, 0, 1, True, output_tokens=4, token_times=(0.1, 0.9)), 0.5, 1.0) == 2


def test_failures_in_the_window_are_counted_and_nothing_succeeded_is_zero() -> None:
    failed = [Sample(w, 1, 1.0, 1.5, False, error="HTTP 500") for w in range(3)]
    stats = summarize(3, failed, level_start=0.0, window=(1.0, 2.0))
    assert (stats.requests, stats.errors, stats.throughput, stats.window) == (0, 3, 0.0, 1.0)


# -- the cost budget ---------------------------------------------------------------------------


def test_a_request_costs_its_prompt_and_the_answer_the_shim_would_price_not_its_max_tokens() -> None:
    clock = ManualClock(0.0)
    costs = CostMeter(clock, prior=100)
    # Before answers are learned: the mix's mean answer.
    assert costs.cost(1800) == 1900
    assert costs.cost(-1) == 100
    # Then the 90th percentile of the answers so far, whatever the request's own max_tokens:
    # the shim prices a client asking for 4096, or naming none, at that (decide/pricing.py).
    for tokens in range(10, 170, 10):  # 16 answers, 10 to 160
        costs.observe(tokens)
    assert costs.answer() == 150
    assert costs.cost(1800) == 1950


def test_the_budget_is_the_cost_rounded_up_to_64() -> None:
    assert budget_tokens(1548.0) == 1600
    assert budget_tokens(64.0) == 64
    assert budget_tokens(1.0) == 64
    for bad in (0.0, -3.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="in-flight cost"):
            budget_tokens(bad)


def test_the_budget_cost_is_what_the_requests_held_most_of_the_time() -> None:
    # Eight requests of 100 in flight for the whole 20 s window, one more of 900 for 1 s of it:
    # what they held 95 % of the time is the eight's 800; the rare pile-up (1700) is not taken
    # as the norm.
    window = (0.0, 20.0)
    eight = [Sample(w, 1, 0.0, 20.0, True, output_tokens=10, cost=100) for w in range(8)]
    spike = Sample(8, 1, 5.0, 6.0, True, output_tokens=10, cost=900)
    assert cost_quantile([*eight, spike], *window) == 800
    assert cost_quantile([*eight, spike], *window, q=1.0) == 1700
    assert cost_quantile([], *window) == 0.0


def test_a_slot_holds_a_request_of_the_mix_in_the_share_named() -> None:
    # A fifth long prompts of 2000 tokens, the rest chat of 100; answers priced at 50.
    cost = slot_cost([100] * 40, [2000] * 10, 0.2, 50)
    assert cost is not None
    assert cost.mean == pytest.approx(0.8 * 150 + 0.2 * 2050)
    assert cost.sd == pytest.approx(math.sqrt(0.8 * 0.2) * 1900)
    assert cost.requests == 50
    # Eight slots: their sum taken as normal, at its 95th percentile.
    assert cost.quantile(8) == pytest.approx(8 * cost.mean + 1.6448536 * math.sqrt(8) * cost.sd)
    assert cost.quantile(8, q=0.5) == pytest.approx(8 * cost.mean)


def test_the_slots_follow_the_share_named_not_the_share_drawn() -> None:
    # However many long prompts a run happened to draw, each slot holds one with the share named:
    # the budget does not follow a few draws.
    few = slot_cost([100] * 45, [2000] * 5, 0.2, 50)
    many = slot_cost([100] * 35, [2000] * 15, 0.2, 50)
    assert few is not None
    assert many is not None
    assert (few.mean, few.sd) == pytest.approx((many.mean, many.sd))


def test_a_slot_counts_the_spread_of_each_kinds_prompts() -> None:
    same = slot_cost([100, 100], [1500, 2500], 0.5, 0)
    assert same is not None
    # E[c] = 1050; E[c^2] = 0.5 * 100^2 + 0.5 * (500^2 + 2000^2).
    assert same.mean == pytest.approx(1050)
    assert same.sd == pytest.approx(math.sqrt(0.5 * 100**2 + 0.5 * (500**2 + 2000**2) - 1050**2))


def test_chat_alone_and_kinds_without_a_request() -> None:
    chat = slot_cost([80, 120], [], 0.0, 20)
    assert chat is not None
    assert (chat.mean, chat.sd, chat.requests) == pytest.approx((120, 20, 2))
    # No long prompt completed: the chat ones take its share.
    assert slot_cost([80, 120], [], 0.3, 20) == chat
    assert slot_cost([], [], 0.2, 50) is None
    assert slot_cost([], [2000], 1.0, 0) == SlotCost(2000, 0, 1)
    with pytest.raises(ValueError, match="long_share"):
        slot_cost([100], [], 1.5, 0)
    with pytest.raises(ValueError, match="slots"):
        chat.quantile(0)
