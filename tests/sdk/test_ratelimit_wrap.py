"""RateLimiter and RetryBudget through wrap(): real openai clients, a real loopback server.

The limiter's clock is frozen (a fake that only the test moves), so its accounting
is exact whatever the machine's speed: no refill happens during a test unless the
test advances the clock.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import llm_backoff
from llm_backoff import RetryPolicy
from llm_backoff.budget import RetryBudget
from llm_backoff.errors import RateLimitTimeout
from llm_backoff.ratelimit import RateLimiter

USAGE = {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}
STREAM_USAGE = {"prompt_tokens": 10, "completion_tokens": 32, "total_tokens": 42}
MESSAGES: Any = [{"role": "user", "content": "say hello"}]


class FrozenClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Body:
    method: str
    content: bytes


@dataclass
class Upstream:
    reject_first: int = 0
    reject_status: int = 429
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = await request.json()
            with self.lock:
                self.calls += 1
                n = self.calls
            if n <= self.reject_first:
                error = {"message": "busy", "type": "server_overloaded", "param": None, "code": "queue_full"}
                return JSONResponse(
                    {"error": error}, status_code=self.reject_status, headers={"retry-after-ms": "5"}
                )
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return StreamingResponse(sse(include_usage), media_type="text/event-stream")
            return JSONResponse(
                {
                    "id": "c1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "hi"},
                        }
                    ],
                    "usage": USAGE,
                }
            )

        return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


async def sse(include_usage: bool) -> AsyncIterator[str]:
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    for word in ["hel", "lo"]:
        choice = {"index": 0, "delta": {"content": word}, "finish_reason": None}
        yield "data: " + json.dumps({**base, "choices": [choice], "usage": None}) + "\n\n"
        await asyncio.sleep(0)
    if include_usage:
        yield "data: " + json.dumps({**base, "choices": [], "usage": STREAM_USAGE}) + "\n\n"
    yield "data: [DONE]\n\n"


@pytest.fixture
def upstream(serve: Callable[[Any], str]) -> tuple[str, Upstream]:
    u = Upstream()
    return serve(u.app()) + "/v1", u


def test_token_charge_is_corrected_from_usage_json_and_streamed(upstream: tuple[str, Upstream]) -> None:
    url, _ = upstream
    limiter = RateLimiter(tokens_per_minute=10_000, clock=FrozenClock())
    client = llm_backoff.wrap(openai.OpenAI(api_key="k", base_url=url), limiter=limiter)
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2000)
    assert limiter.available()["tokens_per_minute"] == 10_000 - 30

    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=2000, stream=True, stream_options={"include_usage": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "hello"
    assert limiter.available()["tokens_per_minute"] == 10_000 - 30 - 42

    # Without usage in the stream the estimate stays charged.
    before = limiter.available()["tokens_per_minute"]
    estimate = limiter.estimate(Body("POST", json.dumps({"messages": MESSAGES, "max_tokens": 2000}).encode()))
    stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2000, stream=True)
    for _ in stream:
        pass
    charged = before - limiter.available()["tokens_per_minute"]
    assert charged > 2000
    assert charged == pytest.approx(estimate, abs=10)  # the SDK adds its own fields to the body
    client.close()


def test_retries_go_through_the_limiter_and_rejections_give_tokens_back(
    upstream: tuple[str, Upstream],
) -> None:
    url, u = upstream
    u.reject_first = 2
    limiter = RateLimiter(requests_per_second=1, burst=10, tokens_per_minute=10_000, clock=FrozenClock())
    client = llm_backoff.wrap(
        openai.OpenAI(api_key="k", base_url=url), RetryPolicy(deadline=10), limiter=limiter
    )
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=500)
    assert u.calls == 3
    left = limiter.available()
    assert left["requests_per_second"] == 10 - 3  # every attempt took a request token
    assert left["tokens_per_minute"] == 10_000 - 30  # the two 429s generated nothing
    client.close()


def test_limit_that_cannot_be_met_in_time_raises_rate_limit_timeout(upstream: tuple[str, Upstream]) -> None:
    url, u = upstream
    limiter = RateLimiter(requests_per_minute=1, clock=FrozenClock())
    client = llm_backoff.wrap(
        openai.OpenAI(api_key="k", base_url=url), RetryPolicy(deadline=5), limiter=limiter
    )
    client.chat.completions.create(model="m", messages=MESSAGES)
    with pytest.raises(RateLimitTimeout):
        client.chat.completions.create(model="m", messages=MESSAGES)  # next slot: 60 s away
    assert u.calls == 1
    client.close()


async def test_one_limiter_shared_by_sync_and_async_clients_threads_and_tasks(
    upstream: tuple[str, Upstream],
) -> None:
    url, _ = upstream
    limiter = RateLimiter(requests_per_second=1, burst=100, tokens_per_minute=100_000, clock=FrozenClock())
    sync_client = llm_backoff.wrap(openai.OpenAI(api_key="k", base_url=url), limiter=limiter)
    async_client = llm_backoff.wrap(openai.AsyncOpenAI(api_key="k", base_url=url), limiter=limiter)

    def in_thread() -> None:
        for _ in range(5):
            sync_client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100)

    threads = [threading.Thread(target=in_thread) for _ in range(2)]
    for t in threads:
        t.start()
    await asyncio.gather(
        *(
            async_client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100)
            for _ in range(10)
        )
    )
    await asyncio.to_thread(lambda: [t.join() for t in threads])
    left = limiter.available()
    assert left["requests_per_second"] == 100 - 20
    assert left["tokens_per_minute"] == 100_000 - 20 * 30
    sync_client.close()
    await async_client.close()


def test_retry_budget_stops_retries_once_spent(upstream: tuple[str, Upstream]) -> None:
    url, u = upstream
    u.reject_first, u.reject_status = 10_000, 503
    budget = RetryBudget(ratio=0.0, min_per_second=0.2, ttl=10.0)  # a reserve of 2 retries
    policy = RetryPolicy(max_attempts=10, deadline=10)
    a = llm_backoff.wrap(openai.OpenAI(api_key="k", base_url=url), policy, budget=budget)
    b = llm_backoff.wrap(openai.OpenAI(api_key="k", base_url=url), policy, budget=budget)
    with pytest.raises(openai.InternalServerError):
        a.chat.completions.create(model="m", messages=MESSAGES)
    assert u.calls == 3  # first attempt + the 2 retries the budget allowed
    with pytest.raises(openai.InternalServerError) as info:
        b.chat.completions.create(model="m", messages=MESSAGES)  # shared: nothing left
    assert u.calls == 4
    assert len(info.value.llm_backoff_attempts) == 1  # type: ignore[attr-defined]
    a.close()
    b.close()


async def test_retry_budget_with_async_client(upstream: tuple[str, Upstream]) -> None:
    url, u = upstream
    u.reject_first = 10_000
    budget = RetryBudget(ratio=0.5, min_per_second=0.0, ttl=10.0)
    client = llm_backoff.wrap(
        openai.AsyncOpenAI(api_key="k", base_url=url), RetryPolicy(max_attempts=5, deadline=10), budget=budget
    )
    for _ in range(4):
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="m", messages=MESSAGES)
    # 4 first attempts earned 2 retries in total (ratio 0.5), spent as they came.
    assert u.calls == 4 + 2
    await client.close()
