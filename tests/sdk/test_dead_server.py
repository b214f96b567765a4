"""How soon a call gives up against a server that is down, or a shim whose engine is: the
tables in docs/sdk.md, computed.

Each policy is stepped on a fake clock (no sleeping) with the error a dead server gives:
``ConnectError`` when the port refuses at once, ``ConnectTimeout`` after openai's default
5 s connect timeout when the host does not answer at all. Every random draw is pinned to
one point of its range: the top (the longest the call can take) or the middle (a typical
call). openai's own retries are computed from its constants the same way (its jitter
takes 0-25 % off each wait: the top is no jitter, the middle 12.5 % off). Behind a shim, each
answer is its 503 ``upstream_unavailable`` with the outage's length so far as the hint.
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import httpx
import pytest
from openai import _constants as openai_constants

from llm_backoff import RetryPolicy
from llm_backoff.attempts import GiveUp, Retry, RetryState
from llm_backoff.classify import classify_exception, classify_status, never_connected

#: openai's connect timeout by default, which a wrapped client keeps.
CONNECT_TIMEOUT = 5.0


class _Pinned(random.Random):
    """Every ``uniform(a, b)`` answers the same point of its range: 1.0 its top, 0.5 its middle."""

    def __init__(self, share: float) -> None:
        super().__init__(0)
        self.share = share

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.share


def give_up(policy: RetryPolicy, share: float, attempt_seconds: float = 0.0) -> tuple[int, float]:
    """(attempts, seconds) until ``policy`` gives up on a server that refuses or never answers."""
    now = 0.0
    state = RetryState(policy, clock=lambda: now, rng=_Pinned(share))
    error = httpx.ConnectError("refused") if attempt_seconds == 0 else httpx.ConnectTimeout("timed out")
    while True:
        started = now
        left = state.time_to_start()  # the transport cuts the connect timeout to the time left
        now += attempt_seconds if left is None else min(attempt_seconds, max(left, 0.0))
        decision = state.decide(classify_exception(policy, error), attempt_started=started, error=str(error))
        if isinstance(decision, GiveUp):
            return state.attempts_made, round(now, 3)
        now += decision.wait


def openai_give_up(share: float, attempt_seconds: float = 0.0) -> tuple[int, float]:
    """The same for openai's own retries: ``max_retries`` retries, ``min(0.5 * 2**n, 8)`` less 0-25 %."""
    retries = openai_constants.DEFAULT_MAX_RETRIES
    jitter = 1.0 - 0.25 * (1.0 - share)
    waits = sum(
        min(openai_constants.INITIAL_RETRY_DELAY * 2.0**n, openai_constants.MAX_RETRY_DELAY) * jitter
        for n in range(retries)
    )
    return retries + 1, round(waits + (retries + 1) * attempt_seconds, 3)


#: name -> ((attempts, seconds) longest, (attempts, seconds) typical) refused, then the same
#: for a silent host: the table in docs/sdk.md ("A server that is down"), which rounds them.
DOCUMENTED = {
    "openai": ((3, 1.5), (3, 1.312), (3, 16.5), (3, 16.312)),
    "RetryPolicy()": ((3, 1.5), (3, 0.75), (3, 16.5), (3, 15.75)),
    "RetryPolicy(max_connect_errors=None)": ((7, 31.5), (9, 45.75), (6, 45.5), (7, 50.75)),
    "RetryPolicy.interactive()": ((3, 0.75), (3, 0.375), (1, 5.0), (1, 5.0)),
    "RetryPolicy.batch()": ((16, 543.5), (26, 571.75), (15, 558.5), (23, 596.75)),
}

POLICIES = {
    "RetryPolicy()": RetryPolicy(),
    "RetryPolicy(max_connect_errors=None)": RetryPolicy(max_connect_errors=None),
    "RetryPolicy.interactive()": RetryPolicy.interactive(),
    "RetryPolicy.batch()": RetryPolicy.batch(),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_documented_give_up_times_of_the_policies(name: str) -> None:
    policy = POLICIES[name]
    computed = tuple(
        give_up(policy, share, seconds) for seconds in (0.0, CONNECT_TIMEOUT) for share in (1.0, 0.5)
    )
    assert computed == DOCUMENTED[name]


def test_the_documented_give_up_times_of_openai() -> None:
    computed = tuple(
        openai_give_up(share, seconds) for seconds in (0.0, CONNECT_TIMEOUT) for share in (1.0, 0.5)
    )
    assert computed == DOCUMENTED["openai"]


#: The shim's answer while its engine cannot be reached: 503 ``upstream_unavailable``, with the
#: outage's length so far as the hint, clamped to the shim's default 1..30 s.
SHIM_UNAVAILABLE = {"error": {"code": "upstream_unavailable", "type": "server_overloaded"}}


def give_up_behind_shim(policy: RetryPolicy, share: float, outage_age: float) -> tuple[int, float]:
    """(attempts, seconds) until ``policy`` gives up on a shim whose engine has been down for
    ``outage_age`` seconds when the call begins (each answer immediate)."""
    now = 0.0
    state = RetryState(policy, clock=lambda: now, rng=_Pinned(share))
    while True:
        hint = min(30.0, max(1.0, outage_age + now))
        verdict = classify_status(policy, 503, {}, SHIM_UNAVAILABLE, hint=hint)
        decision = state.decide(verdict, attempt_started=now, status=503, hint=hint)
        if isinstance(decision, GiveUp):
            return state.attempts_made, round(now, 3)
        now += decision.wait


#: name -> (attempts, seconds) longest and typical against a shim whose engine went down as the
#: call began, then the same with the engine down for 30 s already: the second table of
#: docs/sdk.md ("A server that is down"). ``max_connect_errors=None`` is how every policy
#: treated that answer before it was counted (a busy server's 503, its hint waited out).
DOCUMENTED_BEHIND_SHIM = {
    "RetryPolicy()": ((3, 1.5), (3, 0.75), (3, 1.5), (3, 0.75)),
    "RetryPolicy(max_connect_errors=None)": ((6, 28.111), (7, 44.925), (2, 36.0), (2, 33.0)),
    "RetryPolicy.interactive()": ((3, 0.75), (3, 0.375), (1, 0.0), (1, 0.0)),
    "RetryPolicy.batch()": ((21, 565.844), (23, 572.925), (17, 576.0), (19, 594.0)),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_documented_give_up_times_behind_a_shim_whose_engine_is_down(name: str) -> None:
    policy = POLICIES[name]
    computed = tuple(give_up_behind_shim(policy, share, age) for age in (0.0, 30.0) for share in (1.0, 0.5))
    assert computed == DOCUMENTED_BEHIND_SHIM[name]
    if policy.max_connect_errors is not None:
        # As soon as against a dead server that refuses at once, however old the outage.
        assert computed[:2] == DOCUMENTED[name][:2]


def test_an_unreachable_answer_is_backed_off_like_a_refused_connection_under_the_cap() -> None:
    # Capped: the shim's hint (here 20 s) is not waited for, the computed backoff is.
    now = 0.0
    capped = RetryState(RetryPolicy(), clock=lambda: now, rng=_Pinned(1.0))
    verdict = classify_status(capped.policy, 503, {}, SHIM_UNAVAILABLE, hint=20.0)
    decisions = [capped.decide(verdict, attempt_started=now, status=503, hint=20.0) for _ in range(3)]
    assert [d.wait if isinstance(d, Retry) else None for d in decisions] == [0.5, 1.0, None]
    assert [a.hint for a in capped.history] == [20.0, 20.0, 20.0]  # recorded as the server said
    assert decisions[-1].reason == (
        "status 503 upstream_unavailable: 3 attempts in a row could not connect or found the "
        "upstream unavailable, max_connect_errors (3) reached"
    )
    # Uncapped (the batch preset): an ordinary hint, waited out.
    riding = RetryState(RetryPolicy.batch(), clock=lambda: now, rng=_Pinned(0.0))
    verdict = classify_status(riding.policy, 503, {}, SHIM_UNAVAILABLE, hint=20.0)
    assert riding.decide(verdict, attempt_started=now, status=503, hint=20.0) == Retry(20.0, verdict.reason)


def test_refusals_and_unreachable_answers_count_together_and_any_other_answer_restarts() -> None:
    now = 0.0
    state = RetryState(RetryPolicy(), clock=lambda: now, rng=random.Random(1))
    policy = state.policy
    refused = classify_exception(policy, httpx.ConnectError("refused"))
    shim = classify_status(policy, 503, {}, SHIM_UNAVAILABLE, hint=1.0)
    gateway = classify_status(policy, 502, {}, None)
    busy = classify_status(policy, 503, {}, {"error": {"code": "queue_full"}}, hint=1.0)
    outcomes = (refused, shim, busy, gateway, refused, shim)
    decisions = [state.decide(v, attempt_started=now) for v in outcomes]
    assert [type(d).__name__ for d in decisions] == ["Retry"] * 5 + ["GiveUp"]
    assert "max_connect_errors (3) reached" in decisions[-1].reason


def test_an_attempt_that_reaches_the_server_restarts_the_count() -> None:
    now = 0.0
    state = RetryState(RetryPolicy(max_connect_errors=2), clock=lambda: now, rng=random.Random(1))
    policy = state.policy
    refused = classify_exception(policy, httpx.ConnectError("refused"))
    reset = classify_exception(policy, httpx.ReadError("connection reset"))
    assert (refused.unreachable, reset.unreachable) == (True, False)
    decisions = [state.decide(v, attempt_started=now) for v in (refused, reset, refused, refused)]
    assert [type(d).__name__ for d in decisions] == ["Retry", "Retry", "Retry", "GiveUp"]
    assert decisions[-1].reason.endswith(
        "2 attempts in a row could not connect or found the upstream unavailable, "
        "max_connect_errors (2) reached"
    )


def test_a_server_that_answers_is_waited_out_whatever_the_connect_cap() -> None:
    # A 503 reached the server: only max_attempts and the deadline bound it, as before.
    attempts, _ = give_up_on_status(RetryPolicy(max_connect_errors=1))
    assert attempts == RetryPolicy().max_attempts


def give_up_on_status(policy: RetryPolicy) -> tuple[int, float]:
    now = 0.0
    state = RetryState(policy, clock=lambda: now, rng=_Pinned(0.0))
    verdict = classify_exception(policy, httpx.ReadError("reset"))  # reached the server
    while True:
        decision = state.decide(verdict, attempt_started=now)
        if isinstance(decision, GiveUp):
            return state.attempts_made, now
        now += decision.wait


def test_which_errors_never_connected() -> None:
    openai = pytest.importorskip("openai")
    request = httpx.Request("GET", "http://127.0.0.1:9/")
    assert never_connected(httpx.ConnectError("refused"))
    assert never_connected(httpx.ConnectTimeout("timed out"))
    assert never_connected(ConnectionRefusedError())
    wrapped = openai.APIConnectionError(request=request)
    wrapped.__cause__ = httpx.ConnectError("refused")
    assert never_connected(wrapped)
    assert not never_connected(httpx.ReadError("reset"))
    assert not never_connected(httpx.ReadTimeout("slow"))
    assert not never_connected(httpx.RemoteProtocolError("closed without a response"))
    assert not never_connected(openai.APIConnectionError(request=request))


def test_max_connect_errors_is_checked() -> None:
    with pytest.raises(ValueError, match="max_connect_errors"):
        RetryPolicy(max_connect_errors=0)
    with pytest.raises(ValueError, match="max_connect_errors"):
        RetryPolicy(max_connect_errors=2.5)  # type: ignore[arg-type]
    assert RetryPolicy().max_connect_errors == 3
    assert RetryPolicy.interactive().max_connect_errors == 3
    assert RetryPolicy.batch().max_connect_errors is None


def test_a_wrapped_transport_gives_up_after_three_refusals(lib: ModuleType, fake_time: Any) -> None:
    from llm_backoff.transport import Httpx2RetryTransport, HttpxRetryTransport

    tries: list[float] = []

    def refuse(request: Any) -> Any:
        tries.append(fake_time.now)
        raise lib.ConnectError("refused", request=request)

    cls = Httpx2RetryTransport if lib.__name__ == "httpx2" else HttpxRetryTransport
    retrying = cls(lib.MockTransport(refuse), **fake_time.engine_options())
    with lib.Client(transport=retrying) as client, pytest.raises(lib.ConnectError) as info:
        client.get("http://127.0.0.1:9/v1/models")
    assert len(tries) == 3
    assert len(fake_time.sleeps) == 2
    assert sum(fake_time.sleeps) <= 1.5
    assert "max_connect_errors (3) reached" in str(info.value.__notes__)
