"""bench/bench_admission_model.py: the overload scenarios in virtual time (the real admission
controller against callers making llm_backoff's real retry decisions; no sockets, no sleeping, a
seed gives the same run) and the oracle (greedy EDF, the most a scheduler could deliver on a trace)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import bench_admission_model as oracle
from bench_admission_model import OutputLengths, OverloadModel, service_of
from llm_backoff_shim.lab.demo import shim_flags as demo_shim_flags
from llm_backoff_shim.lab.scenario import EngineShape, Scenario, demo_scenario

SHAPE = EngineShape()  # 8 slots, 1.2 s per request: 6.7 completions/s
BURST = Scenario("burst", burst=200, rate_factor=0, duration=0, deadline=30, ttft_budget=10)
TWICE = Scenario("poisson-2x", burst=0, rate_factor=2.0, duration=30, deadline=30, ttft_budget=10)


def flags(scenario: Scenario) -> list[str]:
    """The shim of these scenarios: every class shares the interactive bounds (the bounds the
    burst and 2x targets were set on; the demo itself holds batch)."""
    return demo_shim_flags(SHAPE, scenario, hold_batch=False)


def run(scenario: Scenario, seed: int, *, start_deadline: bool, extra: tuple[str, ...] = ()) -> OverloadModel:
    return OverloadModel(
        scenario, SHAPE, [*flags(scenario), *extra], seed=seed, start_deadline=start_deadline
    )


@pytest.mark.parametrize("scenario", [BURST, TWICE], ids=lambda s: s.name)
@pytest.mark.parametrize("start_deadline", [False, True], ids=["deadline", "start-deadline"])
def test_every_call_ends_and_every_slot_comes_back(scenario: Scenario, start_deadline: bool) -> None:
    model = run(scenario, 1, start_deadline=start_deadline)
    result = model.run()  # raises if a call hangs or a slot or queue place is left taken
    assert len(result.calls) == len(model.arrivals)
    assert all(c.outcome in ("ok", "gave up", "deadline") for c in result.calls)
    assert model.controller.estimator.samples > 0


def test_a_seed_gives_the_same_run() -> None:
    first = run(TWICE, 3, start_deadline=True).run()
    again = run(TWICE, 3, start_deadline=True).run()
    assert first.summary() == again.summary()
    assert [c.outcome for c in first.calls] == [c.outcome for c in again.calls]


def test_the_burst_with_a_30_s_deadline_meets_the_burst_target_in_every_seed() -> None:
    """>= 95 % of a burst of 200 served within 30 s (the engine can finish 192), few attempts,
    no retry wave: the burst targets for shim + llm_backoff, on the admission policy alone."""
    for seed in range(1, 11):
        result = run(BURST, seed, start_deadline=False).run()
        assert result.successes >= 190, (seed, result.summary())
        assert result.attempts <= 2 * len(result.calls), (seed, result.summary())
        assert result.largest_retry_wave <= 10, (seed, result.summary())
        admitted, retried = result.first_retry_admitted
        assert admitted >= 0.8 * retried, (seed, result.summary())


def test_lent_reservations_are_what_keeps_the_burst_engine_busy() -> None:
    # Without an interactive reservation there is nothing to lend: the burst is served as well.
    # The same seeds with lending taken away (a reservation held whatever is foreseen) lose
    # successes to slots kept idle for interactive callers not due for seconds.
    # On a fixed queue of two turns of the slots: on the queue the engine drains within the
    # 10 s wait (about 100 places) both serve as many (1918 and 1920 of 2000) and lending idles
    # 60 slot-s against 28, at the burst's end.
    seeds = range(1, 11)
    two_turns = ("--max-queue", str(2 * SHAPE.slots))
    no_reservation = (*two_turns, "--reserved-share", "interactive=0")
    unreserved = [run(BURST, s, start_deadline=False, extra=no_reservation).run() for s in seeds]
    lending = [run(BURST, s, start_deadline=False, extra=two_turns).run() for s in seeds]
    assert sum(r.successes for r in lending) >= sum(r.successes for r in unreserved) - 5
    assert sum(r.idle_slot_seconds for r in lending) < 1.5 * sum(r.idle_slot_seconds for r in unreserved)


def test_the_demo_turns_nobody_away_after_a_wait() -> None:
    """Every refusal in the demo's load is at once (its p99 time to rejection): none after
    waiting in the queue, as batch requests queued on free slots they could not use were."""
    scenario = demo_scenario(quick=False)
    for seed in range(1, 11):
        result = run(scenario, seed, start_deadline=True).run()
        assert result.refused_after_a_wait == [], (seed, result.summary())
        assert sum(len(c.refusal_times) for c in result.calls) > 50  # it is overloaded


def test_engine_jitter_varies_the_service_and_still_loses_nothing() -> None:
    exact = run(TWICE, 2, start_deadline=True).run()
    jittered = OverloadModel(TWICE, SHAPE, flags(TWICE), seed=2, start_deadline=True, service_jitter=0.1)
    result = jittered.run()  # raises if a call hangs or a slot is left taken
    assert result.summary() != exact.summary()
    services = {round(end - start, 6) for start, end in jittered._busy if end - start > 1.0}
    assert len(services) > 10
    assert all(1.08 - 1e-9 <= s <= 1.32 + 1e-9 for s in services)


VARIED = Scenario("varied-2x", burst=0, rate_factor=2.0, duration=30, deadline=20, ttft_budget=5)
LENGTHS = OutputLengths(median=20, sigma=0.8, cap=160)


def test_output_lengths_are_drawn_per_call_and_set_the_capacity() -> None:
    model = OverloadModel(VARIED, SHAPE, flags(VARIED), seed=1, lengths=LENGTHS)
    result = model.run()  # raises if a call hangs or a slot is left taken
    tokens = [c.tokens for c in result.calls]
    assert len(set(tokens)) > 20
    assert min(tokens) >= 1
    assert max(tokens) <= 160
    assert all(c.service == service_of(SHAPE, c.tokens) for c in result.calls)
    assert 20 < LENGTHS.mean() < 30  # a lognormal's mean lies above its median
    assert model.capacity < SHAPE.capacity
    assert 0 < result.useful_tokens <= result.offered_tokens
    assert 0 <= result.idle_while_servable <= SHAPE.slots * result.last_completion
    assert model.controller.estimator.token_rate is not None  # max_tokens reached the shim


def test_varied_lengths_leave_no_slot_idle_while_a_caller_could_use_it() -> None:
    """Work conservation on the admission policy alone: with output lengths varied (lognormal),
    the median share of engine slot-time left idle while a caller that could still have been
    served waited is at most 2 % over 10 seeds (3.5 % over 20 seeds with the reservation kept
    from batch whatever its request's length)."""
    shares = sorted(
        OverloadModel(VARIED, SHAPE, flags(VARIED), seed=seed, lengths=LENGTHS)
        .run()
        .idle_while_servable_share
        for seed in range(1, 11)
    )
    assert (shares[4] + shares[5]) / 2 <= 0.02, shares


# -- the oracle ---------------------------------------------------------------------------------


def test_a_job_is_useful_until_its_first_token_or_its_end_would_be_late() -> None:
    interactive = oracle.job(10.0, 11, "interactive", ttft=0.5, itl=0.1, deadline=20.0, ttft_budget=5.0)
    assert interactive.service == pytest.approx(1.5)
    assert interactive.latest_start == pytest.approx(14.5)  # first token by 15 s
    batch = oracle.job(10.0, 11, "batch", ttft=0.5, itl=0.1, deadline=20.0, ttft_budget=None)
    assert batch.latest_start == pytest.approx(28.5)  # ends by 30 s


def test_the_soonest_latest_start_goes_first_and_late_work_is_dropped_not_served() -> None:
    jobs = [
        oracle.Job(0.0, 10, 4.0, 16.0, "batch"),  # can wait
        oracle.Job(0.0, 10, 4.0, 1.0, "interactive"),  # must start by 1 s
        oracle.Job(0.0, 10, 4.0, 2.0, "interactive"),  # must start by 2 s: the slot is busy to 4 s
    ]
    result = oracle.schedule(jobs, 1)
    assert result.served_by_class == {"interactive": 1, "batch": 1}
    assert result.useful_tokens == 20
    assert result.busy_slot_seconds == pytest.approx(8.0)
    assert result.offered_by_class == {"batch": 1, "interactive": 2}


def test_a_slot_idles_only_until_the_next_arrival() -> None:
    jobs = [oracle.Job(0.0, 5, 1.0, 0.0, "batch"), oracle.Job(3.0, 5, 1.0, 3.0, "batch")]
    result = oracle.schedule(jobs, 1)
    assert result.served == 2  # the second starts at its arrival, 2 s after the first ended


def test_more_slots_never_deliver_less() -> None:
    jobs = [oracle.Job(i * 0.1, 8, 1.0, i * 0.1 + 1.5, "interactive") for i in range(40)]
    served = [oracle.schedule(jobs, slots).served for slots in (1, 2, 4, 8)]
    assert served == sorted(served)
    assert served[-1] == 40
    with pytest.raises(ValueError, match="slots"):
        oracle.schedule(jobs, 0)


def test_classes_first_serves_the_first_class_before_an_earlier_deadline_of_another() -> None:
    jobs = [
        oracle.Job(0.0, 10, 4.0, 1.0, "batch"),  # must start by 1 s
        oracle.Job(0.0, 10, 4.0, 3.0, "interactive"),  # must start by 3 s
    ]
    assert oracle.schedule(jobs, 1).served_by_class == {"batch": 1}  # EDF: batch, then too late
    first = oracle.schedule(jobs, 1, classes_first=("interactive",))
    assert first.served_by_class == {"interactive": 1}  # the batch job's latest start passed
    assert first.useful_tokens == 10
