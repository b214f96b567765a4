"""Pacing sends by the budget the server states: the decisions on a fake clock, then real clients.

The loopback tests count what the server refused: a quota server (a token bucket of
``LIMIT`` requests) answers every request with OpenAI's or Anthropic's headers and a 429
beyond the quota. Their assertions hold by causality, not speed: a client reads a reset
on the server's answer, so the instant it waits for is never before the server's.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tests.sdk.conftest import FakeTime

import llm_backoff
from llm_backoff import RetryPolicy
from llm_backoff.errors import RateLimitTimeout
from llm_backoff.pacing import RECHECK, PaceState, ServerPacer
from llm_backoff.ratelimit import BucketState
from llm_backoff.server_budget import Limit
from llm_backoff.tokens import estimate_tokens

# -- the decisions ---------------------------------------------------------------------


def requests_limit(remaining: float, reset: float | None = 10.0, limit: float | None = 5.0) -> list[Limit]:
    return [Limit("requests", "requests", remaining, reset, limit)]


def test_nothing_stated_nothing_held() -> None:
    state = PaceState()
    assert state.wait(0, now=0.0) == 0.0
    for _ in range(100):
        state.take(0)
    assert state.wait(0, now=0.0) == 0.0


def test_the_stated_remaining_is_shared_by_the_sends_after_it() -> None:
    state = PaceState()
    first = state.take(0)
    state.observe(first, requests_limit(2), now=0.0)
    state.take(0)
    assert state.wait(0, now=1.0) == 0.0
    state.take(0)
    assert state.wait(0, now=1.0) == 9.0  # spent: until the stated reset


def test_an_earlier_send_still_unanswered_counts_against_the_budget() -> None:
    state = PaceState()
    state.take(0)  # still unanswered
    later = state.take(0)
    state.observe(later, requests_limit(1), now=0.0)  # the server may not have counted `early` yet
    assert state.wait(0, now=0.0) == 10.0


def test_at_the_reset_only_the_limit_goes_and_sends_in_flight_count_in_the_new_window() -> None:
    state = PaceState()
    seen = state.take(0)
    state.observe(seen, requests_limit(0, reset=10.0, limit=3), now=0.0)
    assert state.wait(0, now=5.0) == 5.0
    state.take(0)  # in flight over the reset (a caller that did not wait; it may land after it)
    granted = 0
    while state.wait(0, now=10.0) == 0.0:
        state.take(0)
        granted += 1
    assert granted == 2
    assert state.wait(0, now=10.0) == RECHECK  # the rest wait for answers, not for a time


def test_a_refilling_limit_paces_at_its_refill_rate_a_window_waits_for_the_reset() -> None:
    for refills, first_wait in ((True, 1.0), (False, 60.0)):
        state = PaceState()
        seen = state.take(0)
        state.observe(seen, [Limit("requests", "requests", 0, 60.0, 60, refills)], now=0.0)
        assert state.wait(0, now=0.0) == pytest.approx(first_wait)
        assert state.wait(0, now=30.0) == (0.0 if refills else 30.0)
        sent = 0
        while state.wait(0, now=30.0) == 0.0:
            state.take(0)
            sent += 1
        assert sent == (30 if refills else 0)  # half the window: half the limit back


def test_without_a_stated_limit_one_send_asks_after_the_reset() -> None:
    state = PaceState()
    seen = state.take(0)
    state.observe(seen, requests_limit(0, reset=1.0, limit=None), now=0.0)
    assert state.wait(0, now=1.0) == 0.0
    probe = state.take(0)
    assert state.wait(0, now=1.0) == RECHECK
    state.done(probe)  # failed without an answer: nothing left to go by
    assert state.wait(0, now=1.0) == 0.0


def test_tokens_are_paced_by_the_estimate() -> None:
    state = PaceState()
    seen = state.take(100)
    state.observe(seen, [Limit("tokens", "tokens", 250, 6.0, 1000)], now=0.0)
    state.take(100)
    state.take(100)
    assert state.wait(100, now=0.0) == 6.0  # 50 left
    assert state.wait(50, now=0.0) == 0.0
    # At the reset 750 come back, less the 200 in flight that may land in the new window.
    assert state.wait(600, now=6.0) == 0.0
    assert state.wait(601, now=6.0) == RECHECK
    fresh = PaceState()
    fresh.observe(fresh.take(0), [Limit("tokens", "tokens", 1000, 6.0, 1000)], now=0.0)
    assert fresh.wait(5000, now=0.0) == 0.0  # more than the limit is charged as the limit


def test_before_the_reset_only_a_tighter_answer_counts() -> None:
    state = PaceState()
    a, b, c = state.take(0), state.take(0), state.take(0)
    state.observe(a, requests_limit(2), now=0.0)  # the server took `a`, then `c`, then `b`:
    state.observe(b, requests_limit(0), now=0.0)
    state.observe(c, requests_limit(1), now=0.0)  # `c`'s answer came last but is older news
    assert state.wait(0, now=0.0) == 10.0
    after = state.take(0)  # sent anyway (the caller's own choice)
    state.observe(after, requests_limit(4, reset=10.0), now=11.0)  # past the reset: a new window
    assert state.wait(0, now=11.0) == 0.0


# -- the pacer on a fake clock -----------------------------------------------------------


class _Request:
    method = "POST"
    content = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}'


def headers_of(values: dict[str, str]) -> tuple[list[str], Callable[[str], str | None]]:
    return list(values), values.get


def test_the_pacer_waits_for_the_reset_on_its_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTime()
    monkeypatch.setattr(time, "sleep", fake.sleep)
    pacer = ServerPacer(clock=fake.clock)
    ticket = pacer.acquire(_Request(), timeout=None)
    pacer.observe(
        ticket, *headers_of({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"})
    )
    pacer.acquire(_Request(), timeout=None)
    assert fake.sleeps == [2.0]


def test_the_pacer_fails_fast_when_the_reset_is_past_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTime()
    monkeypatch.setattr(time, "sleep", fake.sleep)
    pacer = ServerPacer(clock=fake.clock)
    ticket = pacer.acquire(_Request(), timeout=None)
    pacer.observe(
        ticket, *headers_of({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m"})
    )
    with pytest.raises(RateLimitTimeout):
        pacer.acquire(_Request(), timeout=30.0)
    assert fake.sleeps == []
    assert pacer.state.sends == 1  # nothing taken


def test_the_pacer_estimates_tokens_only_once_a_token_limit_is_stated() -> None:
    fake = FakeTime()
    pacer = ServerPacer(clock=fake.clock)
    first = pacer.acquire(_Request(), timeout=None)
    assert first.cost == 0
    pacer.observe(first, *headers_of({"x-ratelimit-remaining-tokens": "1000"}))
    assert pacer.acquire(_Request(), timeout=None).cost == estimate_tokens(_Request.content)


def test_the_async_pacer_sleeps_with_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTime()

    async def fake_sleep(seconds: float) -> None:
        fake.sleep(seconds)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    pacer = ServerPacer(clock=fake.clock)

    async def main() -> None:
        ticket = await pacer.acquire_async(_Request(), timeout=None)
        pacer.observe(ticket, *headers_of({"ratelimit": '"default";r=0;t=3'}))
        await pacer.acquire_async(_Request(), timeout=5)

    asyncio.run(main())
    assert fake.sleeps == [3.0]


# -- real clients against a real quota server ------------------------------------------------

COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "m",
    "content": [{"type": "text", "text": "ok"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 5, "output_tokens": 1},
}
LIMIT = 3


@dataclass
class QuotaServer:
    """A token bucket of ``LIMIT`` requests, full again after ``window`` s (OpenAI's and Anthropic's
    kind of limit), stated on every answer."""

    window: float
    family: str = "openai"
    bucket: BucketState = field(init=False)
    refused: int = 0
    admitted: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.bucket = BucketState(LIMIT / self.window, LIMIT, LIMIT, time.monotonic())

    def headers(self, remaining: int, reset: float) -> dict[str, str]:
        if self.family == "anthropic":
            # A wall-clock reset is read against the client's wall clock: pad it.
            at = datetime.fromtimestamp(time.time() + reset + 0.002, tz=timezone.utc).isoformat()
            return {
                "anthropic-ratelimit-requests-limit": str(LIMIT),
                "anthropic-ratelimit-requests-remaining": str(remaining),
                "anthropic-ratelimit-requests-reset": at,
            }
        return {
            "x-ratelimit-limit-requests": str(LIMIT),
            "x-ratelimit-remaining-requests": str(remaining),
            # Rounded up, so that a client never reads a reset before the real one.
            "x-ratelimit-reset-requests": f"{math.ceil(reset * 1000)}ms",
        }

    def app(self) -> Starlette:
        async def answer(request: Request) -> Response:
            await request.body()
            with self.lock:
                self.bucket.refill(time.monotonic())
                admitted = self.bucket.tokens >= 1.0
                if admitted:
                    self.bucket.take(1.0)
                    self.admitted += 1
                else:
                    self.refused += 1
                level = self.bucket.tokens
            reset = (LIMIT - level) / self.bucket.rate
            headers = self.headers(math.floor(level), reset)
            if admitted:
                body = MESSAGE if request.url.path.endswith("messages") else COMPLETION
                return JSONResponse(body, headers=headers)
            headers["retry-after-ms"] = str(math.ceil((1.0 - level) / self.bucket.rate * 1000))
            error = {"message": "quota", "type": "rate_limit_exceeded", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=429, headers=headers)

        return Starlette(
            routes=[Route(p, answer, methods=["POST"]) for p in ("/v1/chat/completions", "/v1/messages")]
        )


ASK: Any = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_spent_quota_is_not_asked_again_before_its_reset(serve: Callable[..., str]) -> None:
    server = QuotaServer(window=3600.0)
    url = serve(server.app())
    client = llm_backoff.wrap(openai.OpenAI(base_url=f"{url}/v1", api_key="k"), RetryPolicy(deadline=30))
    for _ in range(LIMIT):
        client.chat.completions.create(**ASK)
    for _ in range(3):
        with pytest.raises(RateLimitTimeout):
            client.chat.completions.create(**ASK)
    assert (server.admitted, server.refused) == (LIMIT, 0)


def test_switched_off_the_spent_quota_is_asked_and_refused(serve: Callable[..., str]) -> None:
    server = QuotaServer(window=3600.0)
    url = serve(server.app())
    client = llm_backoff.wrap(
        openai.OpenAI(base_url=f"{url}/v1", api_key="k"), RetryPolicy(deadline=30), follow_rate_headers=False
    )
    for _ in range(LIMIT):
        client.chat.completions.create(**ASK)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**ASK)
    assert server.refused == 1


def test_threads_wait_for_the_window_instead_of_collecting_429s(serve: Callable[..., str]) -> None:
    server = QuotaServer(window=0.25)
    url = serve(server.app())
    client = llm_backoff.wrap(openai.OpenAI(base_url=f"{url}/v1", api_key="k"), RetryPolicy(deadline=30))
    client.chat.completions.create(**ASK)  # the first answer states the budget
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: client.chat.completions.create(**ASK), range(4 * LIMIT)))
    assert server.refused == 0
    assert server.admitted == 4 * LIMIT + 1


def test_tasks_of_an_anthropic_client_wait_too(serve: Callable[..., str]) -> None:
    server = QuotaServer(window=0.25, family="anthropic")
    url = serve(server.app())

    async def main() -> None:
        client = llm_backoff.wrap(
            anthropic.AsyncAnthropic(base_url=url, api_key="k"), RetryPolicy(deadline=30)
        )
        async with client:
            ask = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
            await client.messages.create(**ask)
            await asyncio.gather(*(client.messages.create(**ask) for _ in range(3 * LIMIT)))

    contextvars.copy_context().run(asyncio.run, main())
    assert server.refused == 0
    assert server.admitted == 3 * LIMIT + 1


def test_the_switch_takes_only_a_bool() -> None:
    with pytest.raises(TypeError, match="follow_rate_headers must be True or False"):
        llm_backoff.wrap(
            openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k"), follow_rate_headers="no"
        )  # type: ignore[arg-type]
