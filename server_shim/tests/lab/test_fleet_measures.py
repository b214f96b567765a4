"""bench/bench_fleet.py's figures: the fleet benchmark's trace split, work-conserved ratio, oracle trace
and refusals while a replica had room (pure, no load)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from bench_admission_model import schedule
from bench_fleet import (
    Visit,
    conservation,
    oracle_jobs,
    prompt_tokens,
    refused_with_room,
    requeued_after_wait,
    split_trace,
    visits,
)
from llm_backoff_shim.lab.scenario import Arrival, EngineShape, Scenario, arrivals


def test_the_split_deals_every_call_once_renumbered_in_time_order() -> None:
    calls = [Arrival(i, i * 0.1, "interactive" if i % 3 else "batch", f"p{i}", 10 + i) for i in range(300)]
    parts = split_trace(calls, 3, random.Random(7))
    assert sum(len(p) for p in parts) == 300
    dealt = sorted((c.prompt or "", c.at) for p in parts for c in p)
    assert dealt == sorted((c.prompt or "", c.at) for c in calls)
    for part in parts:
        assert [c.index for c in part] == list(range(len(part)))
        assert [c.at for c in part] == sorted(c.at for c in part)
        assert 60 < len(part) < 140  # a third each, give or take
    assert split_trace(calls, 3, random.Random(7)) == parts  # seeded


def test_the_split_rejects_no_parts() -> None:
    with pytest.raises(ValueError, match="parts"):
        split_trace([], 0, random.Random(1))


def test_work_conserved_is_the_fleet_over_n_times_one_replica() -> None:
    assert conservation(2850, 1000, 3) == pytest.approx(0.95)
    assert conservation(3000, 1000, 3) == pytest.approx(1.0)
    assert conservation(500, 0, 3) is None
    with pytest.raises(ValueError, match="replicas"):
        conservation(1, 1, 0)


def test_a_call_holds_a_slot_for_its_first_token_prefill_and_tokens() -> None:
    shape = EngineShape(slots=8, ttft=0.1, itl=0.02, output_tokens=64, prefill_time_per_token=0.001)
    scenario = Scenario("s", burst=0, rate_factor=2, duration=10, deadline=20, ttft_budget=5)
    prompt = "the of and to in is it you that he"  # 10 words: 17 tokens
    assert prompt_tokens(prompt) == 17
    (inter, batch) = oracle_jobs(
        [Arrival(0, 1.0, "interactive", prompt, 51), Arrival(1, 2.0, "batch", prompt, 51)], shape, scenario
    )
    assert inter.service == pytest.approx(0.1 + 0.017 + 50 * 0.02)
    assert inter.latest_start == pytest.approx(1.0 + 5 - (0.1 + 0.017))  # first token within 5 s
    assert batch.latest_start == pytest.approx(2.0 + 20 - batch.service)  # done within 20 s


def test_pooled_slots_serve_at_least_what_the_replicas_serve_apart() -> None:
    shape = EngineShape(slots=2, ttft=0.1, itl=0.02, output_tokens=64)
    scenario = Scenario("s", burst=0, rate_factor=2, duration=10, deadline=6, ttft_budget=2)
    calls = arrivals(scenario, 3 * shape.capacity, random.Random(3))
    pooled = schedule(oracle_jobs(calls, shape, scenario), 3 * shape.slots).useful_tokens
    apart = sum(
        schedule(oracle_jobs(part, shape, scenario), shape.slots).useful_tokens
        for part in split_trace(calls, 3, random.Random(4))
    )
    assert pooled >= apart > 0


def record(
    t: str, total_ms: float, outcome: str, rid: str, queue_ms: float = 0.0, **extra: Any
) -> dict[str, Any]:
    return {
        "time": t,
        "path": "/v1/chat/completions",
        "outcome": outcome,
        "total_ms": total_ms,
        "queue_ms": queue_ms,
        "request_id": rid,
        **extra,
    }


def test_access_records_become_visits_with_arrival_and_slot_times() -> None:
    (done, refused) = visits(
        2,
        [
            record("2026-12-04T21:00:02.000+00:00", 2000.0, "completed", "1-1", queue_ms=500.0),
            record(
                "2026-12-04T21:00:01.000+00:00", 1.0, "rejected", "2-1", code="queue_full", retry_after_s=0.8
            ),
            {
                "time": "2026-12-04T21:00:01.000+00:00",
                "path": "/health",
                "outcome": "completed",
                "total_ms": 1,
            },
        ],
    )
    assert done.replica == 2
    assert done.end - done.arrival == pytest.approx(2.0)
    assert done.admitted_at == pytest.approx(done.arrival + 0.5)
    assert refused.admitted_at is None
    assert (refused.code, refused.retry_after) == ("queue_full", 0.8)


def busy(replica: int, start: float, end: float, rid: str) -> Visit:
    return Visit(replica, start, end, start, "completed", None, None, rid)


def refusal(replica: int, at: float, rid: str) -> Visit:
    return Visit(replica, at, at + 0.001, None, "rejected", "queue_full", 1.0, rid)


def test_a_refusal_counts_against_the_fleet_only_when_another_replica_had_a_free_slot() -> None:
    # Two replicas of one slot. Replica 0 is busy 0-10 s, replica 1 busy 0-5 s.
    seen = [busy(0, 0.0, 10.0, "a-1"), busy(1, 0.0, 5.0, "b-1")]
    # Call c refused by both at 2 s: the fleet was full. Call d refused by replica 0 alone at
    # 7 s while replica 1 was free: refused with room. Call e refused, then served: not refused.
    seen += [refusal(0, 2.0, "c-1"), refusal(1, 2.001, "c-1"), refusal(0, 7.0, "d-1")]
    seen += [refusal(0, 3.0, "e-1"), busy(1, 5.5, 6.0, "e-1")]
    found = refused_with_room(seen, replicas=2, slots=1)
    assert (found.refused, found.with_room) == (2, 1)
    assert found.tries == {1: 1, 2: 1}
    assert found.share == pytest.approx(0.5)


def test_a_slot_freeing_at_the_instant_of_the_refusal_is_not_room() -> None:
    seen = [busy(0, 0.0, 2.0, "a-1"), busy(0, 2.002, 4.0, "b-1"), refusal(0, 1.9995, "c-1")]
    assert refused_with_room(seen, replicas=1, slots=1).with_room == 0


def test_an_attempt_sent_on_after_a_queue_wait_is_counted_with_its_time_in_the_fleet() -> None:
    waited = Visit(0, 1.0, 6.0, None, "rejected", "queue_timeout", 1.0, "a-1")  # queued 5 s, refused
    served = busy(1, 6.01, 8.0, "a-1")
    fast = [refusal(0, 2.0, "b-1"), busy(1, 2.01, 3.0, "b-1")]  # refused at once, served next door
    alone = [Visit(2, 1.0, 6.0, None, "rejected", "queue_timeout", 1.0, "c-1")]  # not sent on
    found = requeued_after_wait([waited, served, *fast, *alone])
    assert (found.count, found.served) == (1, 1)
    assert found.spans == [pytest.approx(7.0)]
