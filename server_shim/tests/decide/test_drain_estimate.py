"""The drain-rate / Retry-After estimator, driven by a fake clock (no sleeps)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llm_backoff_shim.decide.drain_estimate import DrainEstimator, EstimatorConfig
from llm_backoff_shim.decide.retry_after import HintRequest, retry_after
from llm_backoff_shim.testing import ManualClock


def make(**overrides: float) -> tuple[DrainEstimator, ManualClock]:
    clock = ManualClock(1000.0)
    # return_jitter 0 unless a test sets it: hints as computed, not aimed for clients' jitter.
    values = {
        "retry_after_min": 0.5,
        "retry_after_max": 60.0,
        "initial_service_time": 2.0,
        "return_jitter": 0.0,
    }
    values.update(overrides)
    return DrainEstimator(EstimatorConfig(**values), clock), clock


def test_capacity_rate_is_slots_over_service_time_little_law() -> None:
    est, _ = make(initial_service_time=2.0)
    assert est.capacity_rate(8) == pytest.approx(4.0)
    est.observe_completion("interactive", 0.5)
    # The first measurement replaces the prior outright.
    assert est.service_time == pytest.approx(0.5)
    assert est.capacity_rate(8) == pytest.approx(16.0)


def test_service_time_is_an_ewma_after_the_first_sample() -> None:
    est, _ = make(service_time_alpha=0.5)
    est.observe_completion("interactive", 1.0)
    est.observe_completion("interactive", 3.0)
    assert est.service_time == pytest.approx(2.0)
    est.observe_completion("batch", 4.0)
    assert est.service_time == pytest.approx(3.0)
    assert est.samples == 3


def test_capacity_rate_beats_completion_rate_after_light_traffic() -> None:
    # One request every 10 s, each taking 1 s, on 8 slots: completions/s says 0.1 but
    # the engine could drain 8 per second. The Retry-After must follow capacity.
    est, clock = make(initial_service_time=1.0)
    for _ in range(5):
        clock.advance(10.0)
        est.observe_completion("interactive", 1.0)
    assert est.completion_rate("interactive") < 0.2
    assert est.capacity_rate(8) == pytest.approx(8.0)
    hint = retry_after(est, HintRequest("interactive", ahead=7, slots=8))
    assert hint == pytest.approx(1.0)  # (7 + 1) / 8 per second, not 8 / 0.1


def test_completion_rate_converges_to_steady_rate_and_decays() -> None:
    est, clock = make()
    for _ in range(400):
        clock.advance(0.25)
        est.observe_completion("batch", 1.0)
    steady = est.completion_rate("batch")
    assert steady == pytest.approx(4.0, rel=0.05)
    assert est.completion_rate("interactive") == 0.0
    clock.advance(60.0)  # six time constants of the default 10 s window
    assert est.completion_rate("batch") == pytest.approx(steady * math.exp(-6.0))


def test_retry_after_grows_with_queue_depth() -> None:
    hints = []
    for ahead in range(0, 40, 4):
        est, _ = make(initial_service_time=1.0)
        hints.append(retry_after(est, HintRequest("interactive", ahead=ahead, slots=2)))
    assert hints == sorted(hints)
    assert len(set(hints)) == len(hints)
    assert hints[0] == pytest.approx(0.5)
    assert hints[3] == pytest.approx((12 + 1) / 2)


def test_burst_rejections_get_successive_slots() -> None:
    est, _ = make(initial_service_time=1.0)
    hints = [retry_after(est, HintRequest("interactive", ahead=3, slots=4)) for _ in range(5)]
    # rate 4/s: the k-th caller is told (ahead + k) / rate.
    assert hints == pytest.approx([(3 + k) / 4 for k in range(1, 6)])


def test_fast_drain_bursts_are_spread_above_the_minimum() -> None:
    # 4 slots, 0.1 s each: 40 slots/s, far faster than the 0.5 s minimum hint. Telling
    # everyone "0.5 s" would bring them back in one wave; instead they get 25 ms apart.
    est, _ = make(retry_after_min=0.5)
    est.observe_completion("interactive", 0.1)
    hints = [retry_after(est, HintRequest("interactive", ahead=0, slots=4)) for _ in range(4)]
    assert hints == pytest.approx([0.5, 0.525, 0.55, 0.575])


def test_burst_ends_when_time_passes_the_last_promise() -> None:
    est, clock = make(initial_service_time=1.0)
    first = [retry_after(est, HintRequest("interactive", ahead=0, slots=1)) for _ in range(3)]
    assert first == pytest.approx([1.0, 2.0, 3.0])
    clock.advance(10.0)
    assert retry_after(est, HintRequest("interactive", ahead=0, slots=1)) == pytest.approx(1.0)


def test_all_classes_share_one_promise_timeline() -> None:
    # Each promise claims one slot freeing of the one engine: callers of two classes
    # refused together are spread over one timeline, not promised twice the drain rate.
    est, _ = make(initial_service_time=1.0)
    retry_after(est, HintRequest("interactive", ahead=0, slots=1))
    retry_after(est, HintRequest("interactive", ahead=0, slots=1))
    assert retry_after(est, HintRequest("batch", ahead=0, slots=1)) == pytest.approx(3.0)
    assert retry_after(est, HintRequest("interactive", ahead=0, slots=1)) == pytest.approx(4.0)
    # The promises are still remembered per class (a returning caller counts those of
    # higher classes only).
    assert est.promises.outstanding("interactive") == 3
    assert est.promises.outstanding("batch") == 1


def test_hints_are_clamped_and_promises_beyond_the_clamp_are_dropped() -> None:
    est, clock = make(retry_after_min=1.0, retry_after_max=5.0, initial_service_time=1.0)
    assert retry_after(est, HintRequest("interactive", ahead=100, slots=1)) == 5.0
    assert est.promises.outstanding("interactive") == 1  # kept, at the cap
    # Nobody ahead: the slots before the capped promise are free on the timeline.
    assert retry_after(est, HintRequest("interactive", ahead=0, slots=10)) == 1.0
    clock.advance(5.0)
    # The capped promise expired with the clamp; a new burst starts from the queue alone.
    assert retry_after(est, HintRequest("interactive", ahead=0, slots=10)) == 1.0


def test_a_place_taken_far_ahead_leaves_the_slots_before_it_to_others() -> None:
    est, _ = make(retry_after_min=1.0, retry_after_max=30.0, initial_service_time=1.0)
    # One slot per second. A batch caller is kept out of the next 10 s ...
    assert retry_after(est, HintRequest("batch", ahead=0, slots=1, not_before=10.0)) == 10.0
    # ... and callers turned away after it take the slots before it, one step apart,
    assert [retry_after(est, HintRequest("interactive", ahead=0, slots=1)) for _ in range(9)] == [
        float(k) for k in range(1, 10)
    ]
    # then step over it.
    assert retry_after(est, HintRequest("interactive", ahead=0, slots=1)) == 11.0


def test_a_promise_filling_a_gap_is_remembered_in_order() -> None:
    est, clock = make(retry_after_min=1.0, retry_after_max=30.0, initial_service_time=1.0)
    assert retry_after(est, HintRequest("batch", ahead=0, slots=1, not_before=10.0)) == 10.0
    # A batch caller refused after it fills the gap before it: a promise of the same class
    # earlier than the last one, which must count as much as any (it keeps a slot).
    assert retry_after(est, HintRequest("batch", ahead=0, slots=1)) == 1.0
    assert est.promises.outstanding("batch") == 2
    assert est.promises.promised_within(("batch",), clock(), clock() + 2.0) == 1
    est.promises.redeem("batch")  # the caller due first is back
    assert est.promises.promised_within(("batch",), clock(), clock() + 2.0) == 0
    assert est.promises.outstanding("batch") == 1


def test_expected_wait_counts_free_slots() -> None:
    est, _ = make(initial_service_time=2.0)
    assert est.expected_wait(ahead=0, slots=4, free_slots=1) == 0.0
    assert est.expected_wait(ahead=2, slots=4, free_slots=3) == 0.0
    assert est.expected_wait(ahead=3, slots=4, free_slots=0) == pytest.approx(4 / 2.0)


def test_expected_wait_from_when_the_requests_in_flight_were_admitted() -> None:
    est, clock = make(initial_service_time=2.0)
    # Four slots filled together at t=1000 free together at 1002, not one every 0.5 s.
    together = [1000.0] * 4
    clock.advance(0.5)
    assert est.expected_wait(ahead=0, slots=4, free_slots=0, admitted=together) == pytest.approx(1.5)
    assert est.expected_wait(ahead=3, slots=4, free_slots=0, admitted=together) == pytest.approx(1.5)
    # The fifth to be served waits a whole service time more, on the first lane.
    assert est.expected_wait(ahead=4, slots=4, free_slots=0, admitted=together) == pytest.approx(3.5)
    # Started one after another: the n-th slot frees at its own request's end.
    staggered = [1000.0, 1000.2, 1000.4, 1000.6]
    assert est.expected_wait(ahead=2, slots=4, free_slots=0, admitted=staggered) == pytest.approx(1.9)
    # Fewer in flight than slots: the lanes nobody holds come first, free now.
    assert est.expected_wait(ahead=1, slots=4, free_slots=0, admitted=[1000.0, 1000.2]) == 0.0
    assert est.expected_wait(ahead=2, slots=4, free_slots=0, admitted=[1000.0, 1000.2]) == pytest.approx(1.5)
    # More in flight than this class's slots: the soonest to end are the ones that count.
    assert est.expected_wait(ahead=0, slots=2, free_slots=0, admitted=staggered) == pytest.approx(1.5)
    # A request past its expected end frees "now", never in the past.
    clock.advance(10)
    assert est.expected_wait(ahead=0, slots=4, free_slots=0, admitted=together) == 0.0


def test_each_slot_frees_at_its_own_class_s_end_and_turns_at_the_waiting_class_s_pace() -> None:
    # Chats take 0.5 s, long-prompt batch calls 4.5 s: one estimate over every completion
    # (alpha 1: the last one's, 4.5 s) is right for neither.
    est, clock = make(initial_service_time=1.0, service_time_alpha=1.0)
    for _ in range(4):
        est.observe_completion("interactive", 0.5)
    est.observe_completion("batch", 4.5)
    est.observe_completion("interactive", 0.5)
    assert est.service_time == pytest.approx(0.5)
    est.observe_completion("batch", 4.5)
    assert (est.class_service_time("interactive"), est.class_service_time("batch")) == (0.5, 4.5)
    held = {"interactive": [1000.0, 1000.0], "batch": [1000.0, 1000.0]}
    clock.advance(0.1)
    # The two chat slots free at 0.4 s, the batch ones at 4.4 s (by the one estimate: all at 4.4 s).
    assert est.expected_wait(ahead=1, slots=4, free_slots=0, admitted=held) == pytest.approx(0.4)
    assert est.expected_wait(ahead=2, slots=4, free_slots=0, admitted=held) == pytest.approx(4.4)

    # Chats ahead of a chat turn over on the chat lanes, a chat's service time a turn: the
    # third and fourth do not wait for the batch lanes, nor the fifth.
    def chat(ahead: int) -> float:
        return est.expected_wait(ahead=ahead, slots=4, free_slots=0, admitted=held, turn_class="interactive")

    assert [chat(a) for a in range(6)] == pytest.approx([0.4, 0.4, 0.9, 0.9, 1.4, 1.4])
    # A lower class's turns come at the estimate over every class (chats go first on the lane).
    assert est.expected_wait(ahead=4, slots=4, free_slots=0, admitted=held) == pytest.approx(0.4 + 4.5)
    # A plain list is one class at the estimate over every class.
    assert est.expected_wait(ahead=0, slots=4, free_slots=0, admitted=[1000.0] * 4) == pytest.approx(4.4)


def test_refusals_past_a_full_timeline_keep_no_place() -> None:
    # A storm of refusals at one instant: 8 slots of 2 s drain 4/s, so 30 s hold 120 places.
    est, _ = make(initial_service_time=2.0, retry_after_max=30.0)
    hints = [retry_after(est, HintRequest("interactive", ahead=0, slots=8)) for _ in range(2000)]
    assert hints[-1] == 30.0
    # Places are a step (0.25 s) apart up to the clamp and no further: the timeline, which
    # every refusal scans, stays bounded however long the storm (it held one place per
    # refusal, piled at the clamp, before).
    assert len(est.promises) <= 30.0 * 4 + 1
    assert hints[:3] == sorted(hints[:3])


def test_instant_upstream_does_not_divide_by_zero() -> None:
    est, _ = make()
    est.observe_completion("interactive", 0.0)
    assert est.capacity_rate(4) == pytest.approx(4000.0)
    assert retry_after(est, HintRequest("interactive", ahead=10, slots=4)) == 0.5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"retry_after_min": 0.0},
        {"retry_after_min": 5.0, "retry_after_max": 1.0},
        {"initial_service_time": 0.0},
        {"service_time_alpha": 0.0},
        {"service_time_alpha": 1.5},
        {"rate_window": 0.0},
        {"return_jitter": -0.1},
        {"return_jitter": 1.5},
    ],
)
def test_config_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - several messages, one type
        EstimatorConfig(**kwargs)


@given(
    ahead=st.integers(min_value=0, max_value=10_000),
    slots=st.integers(min_value=1, max_value=512),
    service=st.floats(min_value=0.0, max_value=600.0),
    burst=st.integers(min_value=1, max_value=30),
)
def test_hints_always_inside_the_clamp_and_never_decrease_in_a_burst(
    ahead: int, slots: int, service: float, burst: int
) -> None:
    est, _ = make(retry_after_min=1.0, retry_after_max=30.0)
    est.observe_completion("interactive", service)
    hints = [retry_after(est, HintRequest("interactive", ahead=ahead, slots=slots)) for _ in range(burst)]
    assert all(1.0 <= h <= 30.0 for h in hints)
    assert hints == sorted(hints)


def test_expected_service_is_zero_until_measured_never_the_prior() -> None:
    est, _ = make(initial_service_time=50.0)
    assert est.expected_service(stream=False) == 0.0
    assert est.expected_service(stream=True) == 0.0
    assert est.first_byte_time is None


def test_expected_service_is_the_whole_service_by_default_streams_included() -> None:
    est, _ = make(service_time_alpha=0.5)
    assert est.expected_service(stream=True) == 0.0  # nothing measured: nobody refused on the prior
    est.observe_completion("interactive", 4.0)
    est.observe_first_byte(0.2)
    # A caller whose deadline cuts its stream was not served: it needs the whole service.
    assert est.expected_service(stream=True) == pytest.approx(4.0)
    assert est.expected_service(stream=False) == pytest.approx(4.0)


def test_expected_service_is_first_byte_for_streams_when_served_at_the_first_token() -> None:
    clock = ManualClock(1000.0)
    config = EstimatorConfig(retry_after_min=0.5, service_time_alpha=0.5, stream_served_at="first_token")
    est = DrainEstimator(config, clock)
    est.observe_completion("interactive", 4.0)
    assert est.expected_service(stream=False) == pytest.approx(4.0)
    # A stream before any first byte was measured: only the wait can be judged.
    assert est.expected_service(stream=True) == 0.0
    est.observe_first_byte(0.2)
    est.observe_first_byte(0.6)
    assert est.first_byte_time == pytest.approx(0.4)  # first sample replaces, then EWMA
    assert est.expected_service(stream=True) == pytest.approx(0.4)
    assert est.expected_service(stream=False) == pytest.approx(4.0)


def test_a_stream_needs_its_own_class_s_first_byte_once_measured() -> None:
    est, _ = make(service_time_alpha=1.0)
    # A long prompt's prefill: its first token after 2.5 s; a chat's after 0.1 s.
    est.observe_first_byte(2.5, "batch")
    assert est.expected_service(stream=True, to_start=True, cls="interactive") == pytest.approx(2.5)
    est.observe_first_byte(0.1, "interactive")
    est.observe_first_byte(2.5, "batch")
    assert est.first_byte_time == pytest.approx(2.5)
    assert est.expected_service(stream=True, to_start=True, cls="interactive") == pytest.approx(0.1)
    assert est.expected_service(stream=True, to_start=True, cls="batch") == pytest.approx(2.5)
    # Not measured for a class, or no class: every class's.
    assert est.expected_service(stream=True, to_start=True, cls="bulk") == pytest.approx(2.5)
    assert est.expected_service(stream=True, to_start=True) == pytest.approx(2.5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_nonsense_first_byte_samples_are_ignored(bad: float) -> None:
    est, _ = make()
    est.observe_first_byte(bad)
    assert est.first_byte_time is None


def test_a_hint_the_caller_may_come_back_too_late_for_is_not_a_promise() -> None:
    # Clients add jitter above a hint (up to 20 % by default): a caller told 5 s with 5.5 s
    # of usable budget may come back at 6 s, too late, so no slot is kept for it.
    est, _ = make(retry_after_min=1.0, initial_service_time=1.0, return_jitter=0.2)
    assert est.latest_return(5.0) == pytest.approx(6.0)
    slot = 6.0  # ahead=4 at 1 s each, and one promise already made at 5 s
    retry_after(est, HintRequest("interactive", ahead=4, slots=1))
    told = slot / 1.1
    too_late = retry_after(
        est, HintRequest("interactive", ahead=4, slots=1, keep_within=told * 1.2 - 0.01, aimed=True)
    )
    assert too_late == pytest.approx(told)
    assert est.promises.outstanding("interactive") == 1
    assert retry_after(
        est, HintRequest("interactive", ahead=4, slots=1, keep_within=told * 1.2, aimed=True)
    ) == pytest.approx(told)
    assert est.promises.outstanding("interactive") == 2


def test_hints_are_aimed_so_that_callers_come_back_at_their_slot_on_average() -> None:
    # A client adds uniform(0, 20 %) of the hint: told slot / 1.1, it is back at the slot on
    # average. The promise (what fresh arrivals count) stays at the slot itself.
    est, clock = make(retry_after_min=0.5, initial_service_time=1.0, return_jitter=0.2)
    hints = [retry_after(est, HintRequest("interactive", ahead=3, slots=4, aimed=True)) for _ in range(3)]
    assert hints == pytest.approx([(3 + k) / 4 / 1.1 for k in range(1, 4)])
    # Not aimed (the SLO gate's hints, for one): the slot's delay itself.
    assert retry_after(est, HintRequest("interactive", ahead=3, slots=4)) == pytest.approx(7 / 4)
    assert est.promises.promised_within(("interactive",), clock.now, clock.now + 1.0) == 1
    assert est.promises.promised_within(("interactive",), clock.now, clock.now + 1.5) == 3
    # Never below the minimum: the aim only shortens what lies above it.
    est2, _ = make(retry_after_min=1.0, initial_service_time=0.01, return_jitter=0.2)
    assert retry_after(est2, HintRequest("interactive", ahead=0, slots=1, aimed=True)) == pytest.approx(1.0)


def test_return_jitter_zero_judges_the_hint_itself() -> None:
    est, _ = make(retry_after_min=1.0, initial_service_time=1.0, return_jitter=0.0)
    hint = retry_after(est, HintRequest("interactive", ahead=4, slots=1, keep_within=5.0))
    assert hint == pytest.approx(5.0)
    assert est.promises.outstanding("interactive") == 1


def test_token_rate_is_the_ratio_of_averages_and_prices_a_max_tokens() -> None:
    est, _ = make(service_time_alpha=0.5)
    assert est.token_rate is None
    assert est.run_time(100) is None  # nothing measured: no price, no loan on a guess
    est.observe_tokens(100, 1.0)
    assert est.token_rate == pytest.approx(100.0)
    assert est.run_time(250) == pytest.approx(2.5)
    assert est.run_time(None) is None
    # A short answer and a long one: tokens (300 -> 200) over seconds (1 -> 2), not 150 tok/s.
    est.observe_tokens(300, 3.0)
    assert est.token_rate == pytest.approx(200 / 2.0)
    for tokens, seconds in ((0, 1.0), (10, 0.0), (10, math.nan), (10, -1.0)):
        est.observe_tokens(tokens, seconds)  # not a measurement: ignored
    assert est.token_rate == pytest.approx(100.0)


def test_a_request_needs_its_own_class_service_time_once_measured() -> None:
    # Chat answers take 0.5 s, batch answers 8 s: the mean of both is no measure of what a batch
    # call needs once admitted (admitted on it with 3 s left, its deadline would cut it).
    est, _ = make(service_time_alpha=0.5)
    assert est.expected_service(False, cls="batch") == 0.0  # nothing measured: nobody refused
    for _ in range(6):
        est.observe_completion("interactive", 0.5)
    # Batch unmeasured: every class's estimate.
    assert est.expected_service(False, cls="batch") == pytest.approx(est.service_time)
    est.observe_completion("batch", 8.0)
    assert est.expected_service(False, cls="batch") == pytest.approx(8.0)
    assert est.expected_service(False, cls="interactive") == pytest.approx(0.5)
    assert est.service_time == pytest.approx(0.5 + 0.5 * 7.5)  # the drain rate still counts both
    est.observe_completion("batch", 4.0)
    assert est.class_service_time("batch") == pytest.approx(6.0)
    # A stream served at its first token needs the first token's time, whatever its class.
    est.observe_first_byte(0.2)
    assert est.expected_service(True, to_start=True, cls="batch") == pytest.approx(0.2)
