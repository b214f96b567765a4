"""bench/real_vllm/measures.py: idle slot-time while a caller waited, the engine's pace in a run,
and how interactive calls failed."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from llm_backoff_shim.lab.load_records import AttemptRecord, CallRecord, Sample
from real_vllm.measures import engine_pace, idle_slot_share, interactive_failure_paths


def run(running: list[int], generated: int, step: float = 0.5) -> Any:
    samples = [SimpleNamespace(t=i * step, engine_running=r) for i, r in enumerate(running)]
    return SimpleNamespace(samples=samples, engine_stats={"tokens_generated": generated})


def test_the_pace_is_tokens_per_busy_slot_second_times_the_slots() -> None:
    # 4 slots busy for 1 s, then 2 for 1 s: 6 busy slot-seconds made 600 tokens.
    result = run([4, 4, 2, 2, 0], 600)
    assert engine_pace(result, 8) == pytest.approx(600 / 6 * 8)


def test_a_stalled_sampler_counts_at_most_a_second_per_gap() -> None:
    result = run([8, 0], 800, step=10.0)  # one sample 10 s before the next
    assert engine_pace(result, 8) == pytest.approx(800.0)


def test_no_pace_without_samples_tokens_or_busy_time() -> None:
    assert engine_pace(run([8], 100), 8) is None
    assert engine_pace(run([8, 8], 0), 8) is None
    assert engine_pace(run([0, 0, 0], 100), 8) is None


def call(
    index: int, ends: float, outcome: str, *attempts: tuple[float, float, int], cls: str = "interactive"
) -> Any:
    """A call started at 0 that ended at ``ends``; each attempt (sent, answered, status)."""
    records = [
        AttemptRecord(i, sent, answered, status) for i, (sent, answered, status) in enumerate(attempts)
    ]
    return CallRecord(index, cls, 0.0, 20.0, end=ends, outcome=outcome, attempts=records)  # type: ignore[arg-type]


def test_interactive_failures_are_split_by_how_they_ended() -> None:
    calls = [
        call(0, 0.01, "error", (0.0, 0.01, 429)),  # refused on arrival, gave up
        call(1, 0.02, "error", (0.0, 0.02, 429)),
        call(2, 1.3, "error", (0.0, 0.01, 429), (1.2, 1.3, 429)),  # slept on a hint, refused again
        call(3, 1.9, "error", (0.0, 1.9, 429)),  # queued 1.9 s, then turned away
        call(4, 5.0, "deadline", (0.0, None, None)),  # its own timeout, waiting upstream
        call(5, 2.0, "ok", (0.0, 0.05, 200)),  # served: not a failure
        call(6, 9.0, "error", (0.0, 9.0, 429), cls="batch"),  # not interactive
    ]
    paths = interactive_failure_paths(SimpleNamespace(calls=calls))  # type: ignore[arg-type]
    assert paths == {
        "after retries": (1, 1.3),
        "at once": (2, 0.02),
        "deadline": (1, 5.0),
        "queued, then refused": (1, 1.9),
    }


def sampled(*rows: tuple[float, int, int, int]) -> list[Sample]:
    """Samples (t, engine running, shim queued, shim in flight)."""
    return [Sample(t, running, None, queued, in_flight) for t, running, queued, in_flight in rows]


def alive_from_0_to_4(count: int) -> list[Any]:
    return [CallRecord(i, "batch", 0.0, 20.0, start=0.0, end=4.0) for i in range(count)]


def test_idle_slot_time_counts_the_slots_a_live_caller_not_running_could_use() -> None:
    # 4 slots, 6 callers alive from 0 to 4 s; one sample a second.
    samples = sampled(
        (0.0, 1, 0, 3),  # 3 idle: 2 admitted not yet running, 1 between attempts (6 - 3 - 0 outside)
        (1.0, 2, 1, 2),  # 2 idle: none admitted beyond running, 1 queued, 1 between attempts
        (2.0, 4, 2, 4),  # none idle
        (3.0, 3, 0, 3),  # 1 idle, nobody admitted or queued: between attempts
        (4.0, 0, 0, 0),
    )
    result = SimpleNamespace(calls=alive_from_0_to_4(6), samples=samples)
    slot_time = 4 * 4.0
    assert idle_slot_share(result, 4) == pytest.approx(6 / slot_time)  # type: ignore[arg-type]


def test_idle_is_never_more_than_the_callers_not_running() -> None:
    # 8 slots, 2 callers alive, 1 running: only 1 slot could have been used.
    result = SimpleNamespace(calls=alive_from_0_to_4(2), samples=sampled((0.0, 1, 5, 5), (4.0, 0, 0, 0)))
    assert idle_slot_share(result, 8) == pytest.approx(1 / 32)  # type: ignore[arg-type]
