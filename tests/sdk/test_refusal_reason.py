"""The shim's ``x-llm-backoff-refusal`` header decides a retry: ``final-...`` never, ``retry-...``
always (docs/protocol.md), with real openai clients against a real server on loopback."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import llm_backoff
from llm_backoff import RetryPolicy
from llm_backoff.classify import classify_status
from llm_backoff.testing import instant_retries

MESSAGES: Any = [{"role": "user", "content": "hi"}]
ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
}


def refusing(status: int, reason: str, times: int) -> tuple[Starlette, list[int]]:
    """A server that refuses the first ``times`` calls with ``status`` and ``reason``, then answers."""
    calls: list[int] = []
    lock = threading.Lock()

    async def completions(request: Request) -> Response:
        with lock:
            calls.append(1)
            n = len(calls)
        if n <= times:
            error = {"message": "refused", "type": "server_overloaded", "param": None, "code": "x"}
            return JSONResponse(
                {"error": error},
                status_code=status,
                headers={"retry-after-ms": "10", "x-llm-backoff-refusal": reason},
            )
        return JSONResponse(ANSWER)

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])]), calls


def test_a_final_refusal_is_not_retried_though_its_status_would_be(serve: Callable[..., str]) -> None:
    app, calls = refusing(503, "final-request-too-large", times=5)
    client = llm_backoff.wrap(
        openai.OpenAI(api_key="sk", base_url=serve(app) + "/v1"), RetryPolicy(deadline=30)
    )
    with instant_retries(), pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 503
    assert len(calls) == 1
    (attempt,) = info.value.llm_backoff_attempts  # type: ignore[attr-defined]
    assert "final-request-too-large" in attempt.reason
    client.close()


def test_a_retry_refusal_is_retried_though_its_status_is_not_in_the_policy(serve: Callable[..., str]) -> None:
    app, calls = refusing(409, "retry-queue-full", times=2)
    client = llm_backoff.wrap(
        openai.OpenAI(api_key="sk", base_url=serve(app) + "/v1"), RetryPolicy(deadline=30)
    )
    with instant_retries():
        answer = client.chat.completions.create(model="m", messages=MESSAGES)
    assert answer.choices[0].message.content == "ok"
    assert len(calls) == 3
    client.close()


async def test_the_async_client_reads_it_too(serve: Callable[..., str]) -> None:
    app, calls = refusing(429, "final-class-not-allowed", times=5)
    client = llm_backoff.wrap(
        openai.AsyncOpenAI(api_key="sk", base_url=serve(app) + "/v1"), RetryPolicy(deadline=30)
    )
    with instant_retries(), pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="m", messages=MESSAGES)
    assert len(calls) == 1
    await client.close()


@pytest.mark.parametrize(
    ("status", "headers", "retryable"),
    [
        (503, {"x-llm-backoff-refusal": "final-request-too-large"}, False),
        (429, {"x-llm-backoff-refusal": " FINAL-class-not-allowed "}, False),
        (409, {"x-llm-backoff-refusal": "retry-queue-full"}, True),
        (503, {"x-llm-backoff-refusal": "retry-upstream-unavailable"}, True),
        # Statuses never retried stay so; a value of neither kind changes nothing.
        (400, {"x-llm-backoff-refusal": "retry-queue-full"}, False),
        (503, {"x-llm-backoff-refusal": "maybe"}, True),
        (409, {"x-llm-backoff-refusal": ""}, False),
        # x-should-retry: false wins over a retry- reason.
        (503, {"x-llm-backoff-refusal": "retry-queue-full", "x-should-retry": "false"}, False),
    ],
)
def test_classify(status: int, headers: dict[str, str], retryable: bool) -> None:
    assert classify_status(RetryPolicy(), status, headers).retryable is retryable
