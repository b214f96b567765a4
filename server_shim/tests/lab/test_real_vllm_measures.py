"""bench/real_vllm/measures.py: the engine's pace in a run, from its sampled running count."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from real_vllm.measures import engine_pace


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
