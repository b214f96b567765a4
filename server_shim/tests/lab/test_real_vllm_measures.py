"""bench/real_vllm/measures.py: the engine's pace in a run, from its sampled running count."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from llm_backoff_shim.lab.load_records import AttemptRecord, CallRecord
from real_vllm.measures import engine_pace, interactive_failure_paths


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
