"""The fleet scenario's figures (``llm_backoff_shim.lab.fleet_measures``, the scoreboard's
``bench/fleet_scenario.py``): the trace split, work-conserved ratio, oracle trace, refusals while a
replica had room and asked of every replica, what a dead engine and a restart did to callers,
the refused shares and the shipped rule read (pure, hand-made records, no load)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from bench_admission_model import schedule
from fleet_scenario import oracle_jobs, prompt_tokens, rejected_share_rule, shipped_rejected_share_rule
from llm_backoff_shim.lab.fleet_measures import (
    Visit,
    conservation,
    dead_replica_answers,
    how_they_ended,
    lost_calls,
    refused_share,
    refused_with_room,
    requeued_after_wait,
    split_trace,
    streams_cut,
    visits,
)
from llm_backoff_shim.lab.load_records import AttemptRecord, CallRecord
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
    assert found.share_with_room == pytest.approx(0.5)


def test_a_refused_attempt_counts_as_asked_of_every_replica_by_distinct_replicas_not_tries() -> None:
    # Three replicas. a: refused by all three. b: five tries alternating between two replicas
    # (HAProxy's retries with redispatch), the third never asked. c: refused by one, then served.
    seen = [refusal(0, 1.0, "a-1"), refusal(1, 1.01, "a-1"), refusal(2, 1.02, "a-1")]
    seen += [refusal(r, 2.0 + 0.01 * i, "b-1") for i, r in enumerate((0, 1, 0, 1, 0))]
    seen += [refusal(2, 3.0, "c-1"), busy(0, 3.01, 4.0, "c-1")]
    found = refused_with_room(seen, replicas=3, slots=1)
    assert (found.refused, found.asked_all) == (2, 1)
    assert found.asked == {2: 1, 3: 1}
    assert found.tries == {3: 1, 5: 1}
    assert found.share_asked_all == pytest.approx(0.5)
    assert refused_with_room([], replicas=3, slots=1).share_asked_all is None


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


def call(
    index: int, *attempts: AttemptRecord, outcome: str = "ok", end: float = 5.0, error: str | None = None
) -> CallRecord:
    record = CallRecord(index, "interactive", 0.0, 20.0, end=end, outcome=outcome, error=error)  # type: ignore[arg-type]
    record.attempts = list(attempts)
    return record


def attempt(number: int, status: int | None, code: str | None = None) -> AttemptRecord:
    return AttemptRecord(number, 0.0, status=status, code=code)


def test_a_call_answered_last_by_the_dead_replica_while_its_engine_was_down_is_counted() -> None:
    # Replica 1's engine dead from 10 s to 12 s.
    dead = Visit(1, 10.5, 10.51, None, "rejected", "upstream_unavailable", 1.0, "1-1")
    calls = [call(1, attempt(1, 503, "upstream_unavailable"), outcome="error")]
    seen = [dead]
    # Call 2: the dead replica answered, then the balancer asked replica 0, which served it.
    calls.append(call(2, attempt(1, 200)))
    seen += [
        Visit(1, 10.6, 10.61, None, "rejected", "upstream_unavailable", 1.0, "2-1"),
        busy(0, 10.62, 11, "2-1"),
    ]
    # Call 3: its first attempt got the dead replica's answer; its retry was served elsewhere.
    calls.append(call(3, attempt(1, 503, "upstream_unavailable"), attempt(2, 200)))
    seen += [
        Visit(1, 10.7, 10.71, None, "rejected", "upstream_unavailable", 1.0, "3-1"),
        busy(2, 11.5, 12, "3-2"),
    ]
    # Call 4: answered by replica 1 before its engine died, and call 5 after it was back.
    calls += [call(4, attempt(1, 200)), call(5, attempt(1, 200))]
    seen += [busy(1, 9.0, 9.9, "4-1"), busy(1, 12.5, 13, "5-1")]
    # Call 6: the engine started again at 12 s, but its shim still answered for it as down.
    calls.append(call(6, attempt(1, 503, "upstream_unavailable"), outcome="error"))
    seen.append(Visit(1, 12.2, 12.21, None, "rejected", "upstream_unavailable", 1.0, "6-1"))
    # Call 7: refused by replica 1 for capacity after its engine died: a live replica's answer.
    calls.append(call(7, attempt(1, 429, "queue_full"), outcome="error"))
    seen.append(refusal(1, 10.8, "7-1"))
    assert dead_replica_answers(calls, seen, replica=1, died=10.0) == [1, 6]
    assert dead_replica_answers(calls, seen, replica=1, died=10.55) == [6]


def test_a_stream_cut_is_one_the_replica_had_relayed_before_its_engine_died() -> None:
    cut = Visit(1, 8.0, 10.01, 8.1, "upstream_error", None, None, "1-1")
    done_before = busy(1, 8.0, 9.9, "2-1")
    elsewhere = Visit(0, 8.0, 10.01, 8.1, "upstream_error", None, None, "3-1")
    after = Visit(
        1, 10.5, 10.6, 10.5, "upstream_error", None, None, "4-1"
    )  # never reached the dead engine's work
    refused = Visit(1, 10.2, 10.21, None, "rejected", "upstream_unavailable", 1.0, "5-1")
    left = Visit(1, 8.0, 10.02, 8.1, "client_disconnected", None, None, "6-1")  # its caller closed it
    seen = [cut, done_before, elsewhere, after, refused, left]
    assert streams_cut(seen, replica=1, died=10.0, back=12.0) == 1


def test_a_call_is_lost_when_it_failed_in_the_window_without_a_refusal_to_go_by() -> None:
    calls = [
        call(1, attempt(1, None), outcome="error", end=11.0, error="connection error"),  # no answer: lost
        call(2, attempt(1, 200), outcome="error", end=12.0),  # its answer was cut: lost
        call(3, attempt(1, 503, "upstream_unavailable"), outcome="error", end=13.0),  # "unreachable": lost
        call(4, attempt(1, 429, "queue_full"), outcome="error", end=11.0),  # refused with a hint
        call(5, attempt(1, 503, "queue_timeout"), outcome="error", end=11.0),  # HAProxy's 503 refusal
        call(6, attempt(1, 200), outcome="deadline", end=11.0),  # its own deadline
        call(7, attempt(1, 200), end=11.0),  # served
        call(8, attempt(1, None), outcome="error", end=30.0),  # outside the window
        call(9, attempt(1, None), outcome="error", end=11.0, error="client timeout"),  # its timeout
        # The SDK gave up at its caller's start deadline (no answer could begin in time).
        call(10, attempt(1, None), outcome="error", end=11.0, error="client timeout (start deadline)"),
    ]
    assert lost_calls(calls, 10.0, 20.0) == [1, 2, 3]
    assert lost_calls(calls, 10.0, 20.0, besides=[3]) == [1, 2]
    assert how_they_ended(calls, [1, 2, 3, 7]) == {
        "200": 2,
        "503 upstream_unavailable": 1,
        "no answer: connection error": 1,
    }


def test_the_callers_refused_share_is_refused_attempts_over_answered_ones() -> None:
    calls = [
        call(1, attempt(1, 429, "queue_full"), attempt(2, 200)),
        call(2, attempt(1, 503, "queue_full"), attempt(2, 429, "queue_full"), outcome="error"),
        call(3, attempt(1, None), attempt(2, 200)),  # a connection error is not an answer
    ]
    assert refused_share(calls) == pytest.approx(3 / 5)
    assert refused_share([call(1, attempt(1, None), outcome="error")]) is None


def test_the_rejected_share_rule_is_read_from_the_rules_file() -> None:
    rules = {
        "groups": [
            {"rules": [{"record": "instance:x_rejections:ratio_rate5m", "expr": "1"}, {"alert": "A"}]},
            {"rules": [{"record": "job:x_queue_depth:sum", "expr": "1"}]},
            {"rules": [{"record": "job:x_callers_rejected:ratio_rate5m", "expr": "1"}]},
        ]
    }
    assert rejected_share_rule(rules) == "job:x_callers_rejected:ratio_rate5m"
    assert rejected_share_rule({"groups": rules["groups"][:2]}) == "instance:x_rejections:ratio_rate5m"
    assert rejected_share_rule({"groups": []}) is None
    shipped = shipped_rejected_share_rule()
    assert shipped is not None
    assert shipped.startswith("job:")
