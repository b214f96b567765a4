"""Class-aware defaults: `RetryPolicy.interactive` / `RetryPolicy.batch`, and `wrap` picking them.

Pure checks of the presets and of `RetryState` placing a retry before the start
deadline, then the transport against a mock server on a fake clock (no sleeping).
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import openai
import pytest

import llm_backoff
from llm_backoff.attempts import GiveUp, Retry, RetryState
from llm_backoff.classify import Verdict
from llm_backoff.policy import (
    BATCH_DEADLINE,
    INTERACTIVE_HINT_SHARE,
    INTERACTIVE_START_DEADLINE,
    default_policy,
)
from llm_backoff.transport import RetryEngine
from llm_backoff.wrap import _engine_of

BUSY = Verdict(True, "status 429")


class MaxJitter(random.Random):
    """Every jitter at its largest: the case where the jitter alone pushes a retry past the start."""

    def uniform(self, a: float, b: float) -> float:
        return b


def state(policy: llm_backoff.RetryPolicy, now: list[float]) -> RetryState:
    return RetryState(policy, clock=lambda: now[0], rng=MaxJitter(1))


# -- the presets ---------------------------------------------------------------------------


def test_the_interactive_preset_has_a_start_deadline_and_the_batch_preset_patience() -> None:
    fast = llm_backoff.RetryPolicy.interactive()
    assert fast.start_deadline == INTERACTIVE_START_DEADLINE == 5.0
    assert fast.deadline == 60.0
    assert fast.last_chance == 0.0
    assert fast.max_retry_after == INTERACTIVE_HINT_SHARE * 5.0 == 2.0
    assert llm_backoff.RetryPolicy.interactive(start_deadline=10).max_retry_after == 4.0
    assert fast.max_retry_at == 2.0  # a hinted retry begins within the same share, or none does
    assert llm_backoff.RetryPolicy.interactive(max_retry_after=1).max_retry_at == 1.0
    assert llm_backoff.RetryPolicy.interactive(max_retry_after=1, max_retry_at=3).max_retry_at == 3.0
    assert llm_backoff.RetryPolicy.interactive(last_chance=0.5).max_retry_at is None
    assert llm_backoff.RetryPolicy().max_retry_at is None
    slow = llm_backoff.RetryPolicy.batch()
    assert slow.start_deadline is None
    assert slow.deadline == BATCH_DEADLINE == 600.0
    assert slow.max_retry_after >= 600
    assert slow.deadline is not None
    assert slow.deadline > llm_backoff.RetryPolicy().deadline  # type: ignore[operator]


def test_the_presets_take_any_field_and_check_it() -> None:
    tuned = llm_backoff.RetryPolicy.interactive(start_deadline=2.5, max_attempts=4)
    assert (tuned.start_deadline, tuned.max_attempts, tuned.deadline) == (2.5, 4, 60.0)
    assert llm_backoff.RetryPolicy.interactive(start_deadline=90).deadline == 90
    assert llm_backoff.RetryPolicy.batch(deadline=None).deadline is None
    with pytest.raises(ValueError, match="start_deadline"):
        llm_backoff.RetryPolicy.interactive(start_deadline=-1)
    with pytest.raises(ValueError, match="max_retries"):
        llm_backoff.RetryPolicy.batch(max_retries=3)
    assert llm_backoff.RetryPolicy.interactive() == llm_backoff.RetryPolicy.interactive()  # frozen, hashable
    assert hash(llm_backoff.RetryPolicy.batch()) == hash(llm_backoff.RetryPolicy.batch())


def test_wrap_without_a_policy_picks_the_preset_of_its_class() -> None:
    def policy_of(**kwargs: Any) -> llm_backoff.RetryPolicy:
        wrapped = llm_backoff.wrap(openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k"), **kwargs)
        return _engine_of(wrapped).policy

    assert policy_of(request_class="interactive") == llm_backoff.RetryPolicy.interactive()
    assert policy_of(request_class="batch") == llm_backoff.RetryPolicy.batch()
    assert policy_of(request_class="bulk") == llm_backoff.RetryPolicy()
    assert policy_of() == llm_backoff.RetryPolicy()
    mine = llm_backoff.RetryPolicy(deadline=7)
    assert policy_of(request_class="interactive", policy=mine) is mine
    assert default_policy("interactive") == llm_backoff.RetryPolicy.interactive()


# -- placing a retry before the start deadline -------------------------------------------------


def test_a_hint_that_fits_is_kept_when_only_its_jitter_would_pass_the_start_deadline() -> None:
    now = [0.0]
    calls = state(llm_backoff.RetryPolicy(deadline=60, start_deadline=5), now)
    # hint 4.3 s plus 20 % jitter would begin at 5.16 s, past the 5 s start deadline
    decision = calls.decide(BUSY, attempt_started=0.0, status=429, hint=4.3)
    assert decision == Retry(4.5, "status 429")  # at the latest useful moment: 10 % before it
    # a hint that itself ends past that moment fails, unless the policy grants a last chance
    strict = state(llm_backoff.RetryPolicy(deadline=60, start_deadline=5), now)
    assert isinstance(strict.decide(BUSY, attempt_started=0.0, status=429, hint=4.6), GiveUp)
    lenient = state(llm_backoff.RetryPolicy(deadline=60, start_deadline=5, last_chance=0.5), now)
    assert lenient.decide(BUSY, attempt_started=0.0, status=429, hint=6.0) == Retry(4.5, "status 429")


def test_the_interactive_preset_fails_at_once_on_a_hint_longer_than_its_share_of_the_budget() -> None:
    now = [0.0]
    calls = state(llm_backoff.RetryPolicy.interactive(), now)
    decision = calls.decide(BUSY, attempt_started=0.0, status=429, hint=2.5)  # fits 5 s, but > 2 s
    assert isinstance(decision, GiveUp)
    assert "above max_retry_after (2 s)" in decision.reason
    assert calls.history[-1].wait is None  # no wait was taken: the call ends now
    waits = state(llm_backoff.RetryPolicy.interactive(), now)
    assert isinstance(waits.decide(BUSY, attempt_started=0.0, status=429, hint=2.0), Retry)


def test_the_interactive_preset_waits_out_no_hint_that_would_begin_the_retry_past_its_share() -> None:
    now = [0.0]
    calls = state(llm_backoff.RetryPolicy.interactive(), now)
    assert isinstance(calls.decide(BUSY, attempt_started=0.0, status=429, hint=1.5), Retry)
    now[0] = 1.8  # turned away again (queued, say, then timed out): 1.8 s of its 5 s gone
    decision = calls.decide(BUSY, attempt_started=1.5, status=429, hint=1.0)
    assert isinstance(decision, GiveUp)  # the retry would begin at 2.8 s, past 2 s
    assert "max_retry_at (2 s" in decision.reason
    # A caller that waits out every hint that fits its budget keeps doing so.
    patient = state(llm_backoff.RetryPolicy.interactive(max_retry_after=5), now)
    now[0] = 1.8
    assert isinstance(patient.decide(BUSY, attempt_started=1.5, status=429, hint=1.0), Retry)


def test_the_last_chance_is_taken_once_per_call() -> None:
    now = [0.0]
    calls = state(llm_backoff.RetryPolicy(deadline=60, start_deadline=10, last_chance=0.5), now)
    assert calls.decide(BUSY, attempt_started=0.0, status=429, hint=12.0) == Retry(9.0, "status 429")
    now[0] = 1.0  # an early answer (a connection error, say), then another long hint
    assert isinstance(calls.decide(BUSY, attempt_started=1.0, status=429, hint=12.0), GiveUp)


def test_a_hint_far_past_the_start_deadline_fails_at_once() -> None:
    now = [0.0]
    calls = state(llm_backoff.RetryPolicy(deadline=60, start_deadline=5, last_chance=0.5), now)
    decision = calls.decide(BUSY, attempt_started=0.0, status=429, hint=7.6)  # > 5 s * 1.5
    assert isinstance(decision, GiveUp)
    assert "would pass the 5 s start deadline" in decision.reason


def test_no_retry_is_placed_once_the_latest_useful_moment_has_passed() -> None:
    now = [4.6]
    calls = RetryState(
        llm_backoff.RetryPolicy.interactive(), clock=lambda: now[0], rng=MaxJitter(1), started_at=0.0
    )
    assert isinstance(calls.decide(BUSY, attempt_started=4.0, status=429, hint=0.5), GiveUp)


def test_a_batch_caller_waits_out_a_long_hint() -> None:
    now = [0.0]
    calls = state(llm_backoff.RetryPolicy.batch(), now)
    decision = calls.decide(BUSY, attempt_started=0.0, status=429, hint=200.0)
    assert isinstance(decision, Retry)
    assert decision.wait == pytest.approx(240.0)
    interactive = state(llm_backoff.RetryPolicy(), now)  # the plain default refuses a hint over 120 s
    assert isinstance(interactive.decide(BUSY, attempt_started=0.0, status=429, hint=200.0), GiveUp)


# -- through the transport, on a fake clock ------------------------------------------------------


def test_an_interactive_engine_without_a_policy_waits_a_short_hint_and_fails_at_once_on_a_long_one(
    lib: ModuleType, fake_time: Any
) -> None:
    from llm_backoff import transport

    budgets: list[str] = []
    classes: list[str] = []
    hints = ["1", "3"]

    def server(request: Any) -> Any:
        budgets.append(request.headers["x-request-timeout-ms"])
        classes.append(request.headers["x-request-class"])
        hint = hints[len(budgets) - 1]
        return lib.Response(429, headers={"retry-after": hint}, json={"error": {"message": "busy"}})

    sync_cls = transport.Httpx2RetryTransport if lib.__name__ == "httpx2" else transport.HttpxRetryTransport
    engine = RetryEngine(request_class="interactive", **fake_time.engine_options())
    assert engine.policy == llm_backoff.RetryPolicy.interactive()
    with lib.Client(transport=sync_cls(lib.MockTransport(server), engine=engine), timeout=60) as client:
        response = client.post("http://engine/v1/chat/completions", json={"model": "m"})
    assert response.status_code == 429  # the 3 s hint is past 2 s of the 5 s budget: no second wait
    assert len(fake_time.sleeps) == 1
    assert 1.0 <= fake_time.sleeps[0] <= 1.2  # the 1 s hint and its jitter
    assert budgets[0] == "5000"
    assert 3700 <= int(budgets[1]) <= 4000  # the retry tells the server what is left of the 5 s
    assert classes == ["interactive", "interactive"]
