"""The simulator's scheduler model, driven by a fake clock (no sleeps, no sockets)."""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backoff_shim.sim.engine import (
    AbortReason,
    EngineParams,
    PromptTooLongError,
    QueueFullError,
    SeqState,
    SimEngine,
)
from llm_backoff_shim.testing import ManualClock


def make(clock: ManualClock, **params: object) -> SimEngine:
    defaults: dict[str, object] = {"max_num_seqs": 2, "ttft": 1.0, "itl": 0.1, "itl_batch_factor": 0.0}
    defaults.update(params)
    return SimEngine(EngineParams(**defaults), clock)  # type: ignore[arg-type]


def run_until_idle(engine: SimEngine, clock: ManualClock, limit: int = 10_000) -> None:
    for _ in range(limit):
        due = engine.next_event_time()
        if due is None:
            return
        clock.now = max(clock.now, due)
        engine.step()
    raise AssertionError("engine did not go idle")


def test_batch_is_capped_and_the_rest_wait_in_fifo_order() -> None:
    clock = ManualClock(100.0)
    engine = make(clock, max_num_seqs=2)
    seqs = [engine.add(f"r{i}", max_tokens=3) for i in range(5)]
    assert [s.state for s in seqs] == [SeqState.RUNNING] * 2 + [SeqState.WAITING] * 3
    assert (engine.num_running, engine.num_waiting) == (2, 3)

    admitted_order: list[str] = []
    while engine.next_event_time() is not None:
        clock.now = engine.next_event_time()  # type: ignore[assignment]
        before = {s.request_id for s in seqs if s.state is SeqState.RUNNING}
        engine.step()
        assert engine.num_running <= 2
        admitted_order += [
            s.request_id for s in seqs if s.state is SeqState.RUNNING and s.request_id not in before
        ]
    assert admitted_order == ["r2", "r3", "r4"]
    assert all(s.state is SeqState.FINISHED and s.generated == 3 for s in seqs)
    assert engine.stats.requests_completed == 5
    assert engine.stats.tokens_generated == 15


def test_first_token_after_ttft_then_one_every_itl() -> None:
    clock = ManualClock(10.0)
    engine = make(clock, ttft=0.5, itl=0.2)
    seq = engine.add("a", max_tokens=3)
    assert engine.next_event_time() == pytest.approx(10.5)

    clock.now = 10.49
    assert engine.step() == []
    clock.now = 10.5
    assert engine.step() == [seq]
    assert seq.generated == 1
    assert seq.first_token_at == 10.5
    assert engine.next_event_time() == pytest.approx(10.7)

    clock.now = 10.7
    engine.step()
    clock.now = 10.9
    engine.step()
    assert seq.state is SeqState.FINISHED
    assert seq.finished_at == pytest.approx(10.9)
    assert engine.next_event_time() is None
    assert engine.num_running == 0


def test_inter_token_latency_grows_with_the_batch() -> None:
    clock = ManualClock(0.0)
    engine = make(clock, max_num_seqs=4, ttft=0.0, itl=0.1, itl_batch_factor=0.5)
    for i in range(3):
        engine.add(f"r{i}", max_tokens=10)
    assert engine.current_itl() == pytest.approx(0.1 * (1 + 0.5 * 2))
    engine.step()  # first tokens, due at admission
    assert engine.next_event_time() == pytest.approx(0.2)

    alone = make(ManualClock(0.0), max_num_seqs=4, ttft=0.0, itl=0.1, itl_batch_factor=0.5)
    alone.add("solo", max_tokens=10)
    alone.step()
    assert alone.next_event_time() == pytest.approx(0.1)


def test_max_num_queued_reqs_counts_running_plus_waiting_like_vllm() -> None:
    clock = ManualClock(100.0)
    engine = make(clock, max_num_seqs=2, max_num_queued_reqs=3)
    for i in range(3):
        engine.add(f"r{i}", max_tokens=2)
    with pytest.raises(QueueFullError):
        engine.add("r3", max_tokens=2)
    assert engine.stats.requests_rejected == 1
    assert (engine.num_running, engine.num_waiting) == (2, 1)

    engine.abort("r2")
    engine.add("r4", max_tokens=2)  # room again once one leaves
    assert engine.num_waiting == 1


def test_aborting_a_running_sequence_frees_its_slot_for_the_next_waiter_at_once() -> None:
    clock = ManualClock(100.0)
    engine = make(clock, max_num_seqs=1, ttft=0.0, itl=1.0)
    first = engine.add("first", max_tokens=10)
    second = engine.add("second", max_tokens=10)
    engine.step()
    clock.advance(1.0)
    engine.step()
    assert first.generated == 2

    clock.advance(0.25)
    aborted = engine.abort("first")
    assert aborted is first
    assert first.state is SeqState.ABORTED
    assert second.state is SeqState.RUNNING
    assert second.admitted_at == clock.now
    assert engine.stats.requests_aborted == 1
    assert engine.stats.aborted_tokens == 2
    assert engine.abort("first") is None
    assert engine.abort("never-seen") is None


def test_aborting_a_waiting_sequence_removes_it_from_the_queue() -> None:
    clock = ManualClock(100.0)
    engine = make(clock, max_num_seqs=1)
    engine.add("run", max_tokens=2)
    engine.add("w1", max_tokens=2)
    engine.add("w2", max_tokens=2)
    engine.abort("w1")
    assert engine.num_waiting == 1
    assert engine.stats.aborted_tokens == 0
    run_until_idle(engine, clock)
    assert engine.stats.requests_completed == 2
    assert engine.stats.requests_aborted == 1


def test_fault_aborts_are_not_counted_as_client_departures() -> None:
    clock = ManualClock(100.0)
    engine = make(clock)
    engine.add("a", max_tokens=5)
    clock.advance(1.0)
    engine.step()
    engine.abort("a", AbortReason.FAULT)
    assert engine.stats.requests_aborted == 0
    assert engine.stats.aborted_tokens == 0
    assert engine.num_running == 0


def test_a_late_caller_catches_up_one_token_per_step_on_the_anchored_schedule() -> None:
    clock = ManualClock(0.0)
    engine = make(clock, ttft=0.0, itl=0.1)
    seq = engine.add("a", max_tokens=100)
    clock.now = 0.55  # tokens were due at 0.0, 0.1, ..., 0.5
    steps = 0
    while (due := engine.next_event_time()) is not None and due <= clock.now:
        engine.step()
        steps += 1
    assert steps == 6
    assert seq.generated == 6
    assert engine.next_event_time() == pytest.approx(0.6)


def test_tick_slack_emits_nearly_due_tokens_in_the_same_step() -> None:
    clock = ManualClock(0.0)
    engine = make(clock, max_num_seqs=2, ttft=1.0, tick_slack=0.01)
    a = engine.add("a", max_tokens=5)
    clock.advance(0.005)
    b = engine.add("b", max_tokens=5)
    clock.now = 1.0
    assert set(engine.step()) == {a, b}


def test_peaks_track_the_high_water_mark_and_reset_to_current_occupancy() -> None:
    clock = ManualClock(100.0)
    engine = make(clock, max_num_seqs=2)
    for i in range(5):
        engine.add(f"r{i}", max_tokens=1)
    engine.abort("r4")
    engine.abort("r3")
    assert engine.stats.peak_running == 2
    assert engine.stats.peak_waiting == 3
    assert engine.kv_cache_usage == 1.0

    engine.reset_stats()
    assert engine.stats.requests_aborted == 0
    assert (engine.stats.peak_running, engine.stats.peak_waiting) == (2, 1)


def test_bad_arguments_are_refused() -> None:
    clock = ManualClock(100.0)
    engine = make(clock)
    engine.add("dup", max_tokens=1)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add("dup", max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add("zero", max_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineParams(max_num_seqs=0)
    with pytest.raises(ValueError, match="itl"):
        EngineParams(itl=math.nan)
    with pytest.raises(ValueError, match="max_num_queued_reqs"):
        EngineParams(max_num_queued_reqs=0)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("tick"), st.floats(0.0, 0.5)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    max_num_seqs=st.integers(1, 4),
    limit=st.one_of(st.none(), st.integers(1, 8)),
    factor=st.floats(0.0, 1.0),
)
def test_invariants_hold_under_any_mix_of_arrivals_aborts_and_time(
    ops: list[tuple[str, float]], max_num_seqs: int, limit: int | None, factor: float
) -> None:
    clock = ManualClock(0.0)
    engine = make(clock, max_num_seqs=max_num_seqs, max_num_queued_reqs=limit, itl_batch_factor=factor)
    added: list[str] = []
    seqs = []
    for op, arg in ops:
        if op == "add":
            rid = f"r{len(added)}"
            added.append(rid)
            with contextlib.suppress(QueueFullError):
                seqs.append(engine.add(rid, max_tokens=int(arg)))
        elif op == "abort" and added:
            engine.abort(added[int(arg) % len(added)])
        else:
            clock.advance(arg)
            while (due := engine.next_event_time()) is not None and due <= clock.now:
                engine.step()
        assert engine.num_running <= max_num_seqs
        assert engine.num_waiting == 0 or engine.num_running == max_num_seqs
        if limit is not None:
            assert engine.num_running + engine.num_waiting <= limit
    run_until_idle(engine, clock)

    stats = engine.stats
    assert engine.num_running == engine.num_waiting == 0
    assert len(seqs) + stats.requests_rejected == len(added)
    assert stats.requests_completed + stats.requests_aborted == len(seqs)
    assert stats.tokens_generated == sum(s.generated for s in seqs)
    assert stats.aborted_tokens == sum(s.generated for s in seqs if s.state is SeqState.ABORTED)
    assert all(s.generated == s.max_tokens for s in seqs if s.state is SeqState.FINISHED)
    assert stats.peak_running <= max_num_seqs


# -- work that follows each request: prefill, chunking, the KV cache ---------------------------


def test_time_to_first_token_grows_with_the_prompt() -> None:
    firsts = {}
    for prompt in (0, 100, 1000):
        clock = ManualClock(0.0)
        engine = make(clock, ttft=0.2, itl=0.1, prefill_time_per_token=0.001)
        seq = engine.add("a", max_tokens=2, prompt_tokens=prompt)
        run_until_idle(engine, clock)
        assert seq.first_token_at is not None
        assert seq.finished_at is not None
        firsts[prompt] = seq.first_token_at
        assert seq.finished_at - seq.first_token_at == pytest.approx(0.1)
    assert firsts[0] == pytest.approx(0.2)
    assert firsts[100] == pytest.approx(0.1 + 0.2)
    assert firsts[1000] == pytest.approx(1.0 + 0.2)


def test_attention_makes_prefill_grow_with_the_square_of_the_prompt() -> None:
    """``prefill_attention_time``: P * per_token + attention * P**2 / 2000 in all, chunked or not."""
    firsts = {}
    for prompt, chunk in ((1000, 4096), (2000, 4096), (2000, 500)):
        clock = ManualClock(0.0)
        engine = make(
            clock,
            ttft=0.0,
            prefill_time_per_token=0.0001,
            prefill_attention_time=0.0001,
            max_num_batched_tokens=chunk,
        )
        seq = engine.add("a", max_tokens=1, prompt_tokens=prompt)
        run_until_idle(engine, clock)
        assert seq.first_token_at is not None
        firsts[prompt, chunk] = seq.first_token_at
    # 1000 tokens: 0.1 s linear, and each token attends to the ones before it.
    assert firsts[1000, 4096] == pytest.approx(0.1 + 0.0001 * 1000 * 999 / 2 / 1000)
    assert firsts[2000, 4096] == pytest.approx(0.2 + 0.0001 * 2000 * 1999 / 2 / 1000)
    assert firsts[2000, 4096] > 2 * firsts[1000, 4096]
    # Chunks of 500: each attends to the context prefilled before it; the sum is the same.
    assert firsts[2000, 500] == pytest.approx(firsts[2000, 4096])


def test_admit_time_is_step_time_once_per_request_and_slows_its_neighbours() -> None:
    clock = ManualClock(0.0)
    engine = make(clock, max_num_seqs=2, ttft=0.0, itl=0.1, prefill_time_per_token=0.0, admit_time=0.05)
    decoder = engine.add("decoder", max_tokens=10, prompt_tokens=10)
    engine.step()
    engine.step()
    clock.now = 0.05  # its prefill step carried the admit time
    engine.step()
    assert decoder.first_token_at == pytest.approx(0.05)
    newcomer = engine.add("new", max_tokens=2, prompt_tokens=10)
    run_until_idle(engine, clock)
    assert newcomer.first_token_at is not None
    # The step under way (0.05-0.15), then its prefill step: one decode token plus the admit time.
    assert newcomer.first_token_at == pytest.approx(0.15 + 0.1 + 0.05)
    assert decoder.finished_at is not None
    assert decoder.finished_at == pytest.approx(0.05 + 9 * 0.1 + 0.05)


def test_decode_slows_with_the_context_the_batch_holds() -> None:
    """``decode_attention_time``: each decode step reads every decoding sequence's KV cache."""
    gaps = {}
    for prompt in (0, 2000):
        clock = ManualClock(0.0)
        engine = make(clock, ttft=0.0, itl=0.01, prefill_time_per_token=0.0, decode_attention_time=0.002)
        seq = engine.add("a", max_tokens=3, prompt_tokens=prompt)
        run_until_idle(engine, clock)
        assert seq.first_token_at is not None
        assert seq.finished_at is not None
        gaps[prompt] = (seq.finished_at - seq.first_token_at) / 2
    assert gaps[0] == pytest.approx(0.01 + 0.002 * 1.5 / 1000)
    # 2000 prompt tokens plus the 1-2 generated: 0.002 s per 1000 of them on top of itl.
    assert gaps[2000] == pytest.approx(0.01 + 0.002 * 2001.5 / 1000)


def test_a_long_prompt_is_prefilled_in_chunks_that_slow_the_decode_steps_it_shares() -> None:
    clock = ManualClock(0.0)
    engine = make(
        clock, max_num_seqs=2, ttft=0.0, itl=0.1, prefill_time_per_token=0.001, max_num_batched_tokens=101
    )
    decoder = engine.add("decoder", max_tokens=100)
    engine.step()  # its first token (no prompt, no ttft)
    times: list[float] = []

    def advance() -> None:
        due = engine.next_event_time()
        assert due is not None
        clock.now = max(clock.now, due)
        if decoder in engine.step():
            times.append(clock.now)

    advance()
    advance()
    assert times == [pytest.approx(0.1), pytest.approx(0.2)]
    long = engine.add("long", max_tokens=1, prompt_tokens=250)
    # Chunks of 100 prompt tokens (101 minus the decoder's token) ride along three steps.
    for _ in range(5):
        advance()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[1] == pytest.approx(0.1)  # the step already under way when it arrived
    assert gaps[2:5] == [pytest.approx(0.2), pytest.approx(0.2), pytest.approx(0.15)]
    assert gaps[5] == pytest.approx(0.1)  # prefill done: plain decode steps again
    assert long.state is SeqState.FINISHED
    assert long.first_token_at == pytest.approx(0.85)
    assert long.prefilled == 250
    assert engine.stats.prefill_tokens == 250


def test_a_full_kv_cache_preempts_the_youngest_which_recomputes_and_still_finishes() -> None:
    clock = ManualClock(0.0)
    engine = make(clock, max_num_seqs=4, ttft=0.0, itl=0.1, kv_cache_tokens=40)
    old = engine.add("old", max_tokens=20, prompt_tokens=10)
    young = engine.add("young", max_tokens=15, prompt_tokens=10)
    assert engine.num_running == 2
    seen_preempted = False
    for _ in range(10_000):
        due = engine.next_event_time()
        if due is None:
            break
        clock.now = max(clock.now, due)
        engine.step()
        assert engine.kv_tokens_used <= 40
        if young.state is SeqState.WAITING:
            seen_preempted = True
            assert old.state is SeqState.RUNNING  # the oldest keeps its place
    assert seen_preempted
    assert young.preemptions >= 1
    assert old.preemptions == 0
    assert engine.stats.preemptions == young.preemptions
    assert (old.state, young.state) == (SeqState.FINISHED, SeqState.FINISHED)
    assert (old.generated, young.generated) == (20, 15)
    # The young one's prompt and the tokens it had made were computed again.
    assert engine.stats.prefill_tokens > 20
    assert engine.stats.tokens_generated == 35


def test_a_request_that_can_never_fit_the_kv_cache_is_refused() -> None:
    engine = make(ManualClock(0.0), kv_cache_tokens=100)
    with pytest.raises(PromptTooLongError, match="maximum context length is 100 tokens"):
        engine.add("big", max_tokens=50, prompt_tokens=60)
    engine.add("fits", max_tokens=40, prompt_tokens=60)
    assert engine.num_running == 1


@settings(max_examples=120, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 30), st.integers(0, 40)),
            st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
            st.tuples(st.just("tick"), st.integers(0, 50), st.just(0)),
        ),
        max_size=60,
    ),
    max_num_seqs=st.integers(1, 4),
    kv=st.one_of(st.none(), st.integers(80, 200)),
    chunk=st.integers(4, 64),
)
def test_invariants_hold_with_prompts_chunks_and_a_kv_cache(
    ops: list[tuple[str, int, int]], max_num_seqs: int, kv: int | None, chunk: int
) -> None:
    clock = ManualClock(0.0)
    engine = make(
        clock,
        max_num_seqs=max_num_seqs,
        ttft=0.05,
        itl=0.01,
        itl_batch_factor=0.1,
        prefill_time_per_token=0.001,
        max_num_batched_tokens=max(chunk, max_num_seqs),
        kv_cache_tokens=kv,
    )
    added: list[str] = []
    seqs = []
    for op, a, b in ops:
        if op == "add":
            rid = f"r{len(added)}"
            added.append(rid)
            seqs.append(engine.add(rid, max_tokens=a, prompt_tokens=b))
        elif op == "abort" and added:
            engine.abort(added[a % len(added)])
        else:
            clock.advance(a / 100)
            while (due := engine.next_event_time()) is not None and due <= clock.now:
                engine.step()
        assert engine.num_running <= max_num_seqs
        if kv is not None:
            assert engine.kv_tokens_used <= kv
    run_until_idle(engine, clock)
    stats = engine.stats
    assert engine.num_running == engine.num_waiting == 0
    assert stats.requests_completed + stats.requests_aborted == len(seqs)
    assert stats.tokens_generated == sum(s.generated for s in seqs)
    assert all(s.generated == s.max_tokens for s in seqs if s.state is SeqState.FINISHED)
    assert stats.prefill_tokens >= sum(s.prompt_tokens for s in seqs if s.state is SeqState.FINISHED)
