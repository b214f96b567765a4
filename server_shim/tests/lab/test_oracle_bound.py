"""bench/bench_admission_model.py's oracle: greedy EDF, the most a scheduler could deliver on a trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def load_oracle() -> ModuleType:
    bench = Path(__file__).resolve().parents[3] / "bench"
    sys.path.insert(0, str(bench))  # its own imports live beside it
    spec = importlib.util.spec_from_file_location("bench_admission_model", bench / "bench_admission_model.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_admission_model"] = module
    spec.loader.exec_module(module)
    return module


oracle = load_oracle()


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
