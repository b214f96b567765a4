from __future__ import annotations

import random

import pytest

from llm_backoff import RetryPolicy
from llm_backoff.attempts import GiveUp, Retry, RetryState, format_history
from llm_backoff.classify import Verdict

RETRY = Verdict(True, "status 503")
FATAL = Verdict(False, "status 400 is never retried")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeBudget:
    def __init__(self, credits: int) -> None:
        self.credits = credits
        self.requests = 0

    def record_request(self) -> None:
        self.requests += 1

    def try_spend(self) -> bool:
        if self.credits <= 0:
            return False
        self.credits -= 1
        return True


def state(policy: RetryPolicy, clock: FakeClock, budget: FakeBudget | None = None) -> RetryState:
    return RetryState(policy, clock=clock, rng=random.Random(7), budget=budget)


def test_not_retryable_gives_up_with_the_classification() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(), clock)
    decision = s.decide(FATAL, attempt_started=clock(), status=400)
    assert decision == GiveUp("status 400 is never retried")
    assert s.history[0].status == 400
    assert s.history[0].wait is None


def test_max_attempts_counts_the_first_attempt() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(max_attempts=3, jitter="none", base_delay=1), clock)
    decisions = [s.decide(RETRY, attempt_started=clock(), status=503) for _ in range(3)]
    assert [type(d) for d in decisions] == [Retry, Retry, GiveUp]
    assert [d.wait for d in decisions[:2] if isinstance(d, Retry)] == [1.0, 2.0]
    assert "max_attempts (3)" in decisions[2].reason
    assert [a.number for a in s.history] == [1, 2, 3]
    assert [a.wait for a in s.history] == [1.0, 2.0, None]


def test_hint_above_max_retry_after_stops_at_once() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(max_retry_after=10, deadline=None), clock)
    decision = s.decide(RETRY, attempt_started=clock(), status=429, hint=11.0)
    assert isinstance(decision, GiveUp)
    assert "max_retry_after" in decision.reason
    assert s.history[0].hint == 11.0


def test_a_hint_that_would_begin_the_retry_past_max_retry_at_stops_at_once() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(max_retry_at=3, deadline=None), clock)
    started = clock.now
    first = s.decide(RETRY, attempt_started=started, status=429, hint=2.5)
    assert isinstance(first, Retry)  # it would begin at 2.5 s: within 3 s of the call's start
    clock.now = started + 1.0
    second = s.decide(RETRY, attempt_started=started + 0.5, status=429, hint=2.5)
    assert isinstance(second, GiveUp)  # at 3.5 s: past it, however short the hint itself is
    assert "max_retry_at (3 s; 1 s elapsed)" in second.reason
    assert s.history[-1].wait is None


def test_max_retry_at_leaves_waits_without_a_hint_alone() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(max_retry_at=1, deadline=None, jitter="none", base_delay=2, max_delay=2), clock)
    clock.now += 5.0  # long past max_retry_at: a connection error still gets its backoff
    assert s.decide(RETRY, attempt_started=clock.now, status=None, hint=None) == Retry(2.0, "status 503")


def test_hint_is_honoured_as_a_floor() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(retry_after_jitter=0.2), clock)
    decision = s.decide(RETRY, attempt_started=clock(), status=429, hint=4.0)
    assert isinstance(decision, Retry)
    assert 4.0 <= decision.wait <= 4.8


def test_never_sleeps_past_the_deadline() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(deadline=10, jitter="none", base_delay=1, max_delay=8), clock)
    started = clock()
    clock.now += 8.5  # a slow attempt
    decision = s.decide(RETRY, attempt_started=started, status=503)  # would wait 1 s: 9.5 < 10
    assert decision == Retry(1.0, "status 503")
    clock.now += 1.0
    started = clock()
    clock.now += 0.2  # 9.7 s elapsed, next wait 2 s would cross 10
    decision = s.decide(RETRY, attempt_started=started, status=503)
    assert isinstance(decision, GiveUp)
    assert "deadline" in decision.reason
    assert s.history[-1].duration == pytest.approx(0.2)


def test_hint_longer_than_time_left_gives_up_now() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(deadline=5), clock)
    decision = s.decide(RETRY, attempt_started=clock(), status=429, hint=6.0)
    assert isinstance(decision, GiveUp)
    assert "deadline" in decision.reason


def test_time_left() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(deadline=5), clock)
    clock.now += 2
    assert s.time_left() == 3
    assert state(RetryPolicy(deadline=None), clock).time_left() is None


def test_budget_is_only_spent_when_everything_else_says_retry() -> None:
    clock = FakeClock()
    budget = FakeBudget(credits=1)
    s = state(RetryPolicy(deadline=None), clock, budget)
    assert isinstance(s.decide(FATAL, attempt_started=clock(), status=400), GiveUp)
    assert budget.credits == 1
    assert isinstance(s.decide(RETRY, attempt_started=clock(), status=503), Retry)
    assert budget.credits == 0
    decision = s.decide(RETRY, attempt_started=clock(), status=503)
    assert isinstance(decision, GiveUp)
    assert "budget" in decision.reason


def test_history_records_timing_relative_to_the_call() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(jitter="none", base_delay=1), clock)
    clock.now += 0.5
    started = clock()
    clock.now += 0.25
    s.decide(RETRY, attempt_started=started, error="ReadTimeout: slow")
    attempt = s.history[0]
    assert attempt.started == 0.5
    assert attempt.duration == 0.25
    assert attempt.error == "ReadTimeout: slow"
    assert attempt.status is None


def test_format_history_mentions_every_attempt() -> None:
    clock = FakeClock()
    s = state(RetryPolicy(max_attempts=2, jitter="none", base_delay=1), clock)
    s.decide(RETRY, attempt_started=clock(), status=429, hint=0.5)
    s.decide(Verdict(True, "timeout (ReadTimeout)"), attempt_started=clock(), error="ReadTimeout: slow")
    text = format_history(s.history, s.final_reason)
    assert "2 attempts" in text
    assert "#1 status 429, hint 0.5 s, waited" in text
    assert "#2 ReadTimeout: slow" in text
    assert "max_attempts (2)" in text
