"""End to end: wrapped openai clients against a real HTTP server on 127.0.0.1.

The server is a small starlette app under uvicorn (the ``serve`` fixture). It
rejects the first requests of each caller with a 429 carrying ``retry-after-ms``
(short, so the tests stay fast; the shim sends the same header) and then answers
like an OpenAI-compatible server, streaming (SSE) or not. One route cuts its
event stream half-way by dropping the connection.
"""

from __future__ import annotations

import asyncio
import json
import socket
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
from llm_backoff import RetryEvent, RetryPolicy


@dataclass
class Behaviour:
    rejections: int = 2
    """429s each caller (``x-caller`` header) gets before it is served."""
    retry_after_ms: int = 40
    retry_after: str = "1"
    seen: list[dict[str, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def chunk(text: str) -> str:
    payload = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return f"data: {json.dumps(payload)}\n\n"


def make_app(b: Behaviour) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await request.json()
        caller = request.headers.get("x-caller", "-")
        with b.lock:
            b.seen.append(dict(request.headers))
            n = b.counts[caller] = b.counts.get(caller, 0) + 1
        if n <= b.rejections:
            return JSONResponse(
                {
                    "error": {
                        "message": "server at capacity",
                        "type": "server_overloaded",
                        "param": None,
                        "code": "queue_full",
                        "retry_after_seconds": b.retry_after_ms / 1000,
                    }
                },
                status_code=429,
                headers={"retry-after": b.retry_after, "retry-after-ms": str(b.retry_after_ms)},
            )
        words = ["hello", " ", "world"]
        if body.get("stream"):

            async def events() -> AsyncIterator[str]:
                for w in words:
                    yield chunk(w)
                    await asyncio.sleep(0)
                    if request.url.path.startswith("/cut/") and w == " ":
                        raise RuntimeError("connection dropped mid-stream (test)")
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model", "m"),
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "".join(words)},
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/cut/v1/chat/completions", completions, methods=["POST"]),
        ]
    )


def cut_error(exc: BaseException) -> bool:
    """openai 3.x wraps a broken stream in APIConnectionError; 2.x lets httpx's error through."""
    return isinstance(exc, openai.APIConnectionError) or type(exc).__name__ == "RemoteProtocolError"


MESSAGES: Any = [{"role": "user", "content": "say hello"}]


@pytest.fixture
def server(serve: Callable[[Any], str]) -> tuple[str, Behaviour]:
    behaviour = Behaviour()
    return serve(make_app(behaviour)), behaviour


def test_sync_client_retries_429s_from_a_real_server(server: tuple[str, Behaviour]) -> None:
    url, b = server
    events: list[RetryEvent] = []
    client = llm_backoff.wrap(
        openai.OpenAI(api_key="sk-test", base_url=f"{url}/v1"),  # openai's own default http client
        RetryPolicy(deadline=20),
        on_retry=events.append,
        request_class="batch",
    )
    raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    result = raw.parse()
    assert result.choices[0].message.content == "hello world"
    attempts = raw.http_response.extensions["llm_backoff.attempts"]
    assert [a.status for a in attempts] == [429, 429, 200]
    assert [a.hint for a in attempts] == [0.04, 0.04, None]
    assert [e.attempt for e in events] == [1, 2]
    assert all(0.04 <= e.wait <= 0.048 for e in events)
    assert [h["x-request-class"] for h in b.seen] == ["batch"] * 3
    budgets = [int(h["x-request-timeout-ms"]) for h in b.seen]
    assert budgets == sorted(budgets, reverse=True)
    assert 0 < budgets[-1] < budgets[0] <= 20_000
    # the same request body each time
    client.close()


def test_sync_gives_up_with_the_original_error_type(server: tuple[str, Behaviour]) -> None:
    url, b = server
    b.rejections = 100
    client = llm_backoff.wrap(
        openai.OpenAI(api_key="sk-test", base_url=f"{url}/v1"), RetryPolicy(max_attempts=3)
    )
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.body["retry_after_seconds"] == 0.04  # type: ignore[index]
    assert [a.status for a in info.value.llm_backoff_attempts] == [429] * 3  # type: ignore[attr-defined]
    assert len(b.seen) == 3


def test_deadline_stops_without_sleeping_through_a_long_hint(server: tuple[str, Behaviour]) -> None:
    url, b = server
    b.rejections = 100
    b.retry_after_ms = 30_000
    client = llm_backoff.wrap(openai.OpenAI(api_key="sk-test", base_url=f"{url}/v1"), RetryPolicy(deadline=5))
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert len(b.seen) == 1
    assert "deadline" in "\n".join(info.value.__notes__)


def test_sync_streaming_is_retried_before_it_starts(server: tuple[str, Behaviour]) -> None:
    url, b = server
    b.rejections = 1
    client = llm_backoff.wrap(openai.OpenAI(api_key="sk-test", base_url=f"{url}/v1"))
    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == "hello world"
    assert len(b.seen) == 2


def test_sync_stream_cut_midway_raises_and_is_not_retried(server: tuple[str, Behaviour]) -> None:
    url, b = server
    b.rejections = 0
    client = llm_backoff.wrap(openai.OpenAI(api_key="sk-test", base_url=f"{url}/cut/v1"))
    received: list[str] = []
    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    chunks = iter(stream)
    received.append(next(chunks).choices[0].delta.content or "")
    received.append(next(chunks).choices[0].delta.content or "")
    with pytest.raises(Exception) as info:  # noqa: PT011 - checked below, the type differs by version
        next(chunks)
    assert cut_error(info.value)
    assert [a.status for a in info.value.llm_backoff_attempts] == [200]  # type: ignore[attr-defined]
    assert received == ["hello", " "]
    assert len(b.seen) == 1


def test_connection_refused_is_retried_then_raised() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    client = llm_backoff.wrap(
        openai.OpenAI(api_key="sk-test", base_url=f"http://127.0.0.1:{port}/v1"),
        RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.02),
    )
    with pytest.raises(openai.APIConnectionError) as info:
        client.models.list()
    attempts = info.value.llm_backoff_attempts  # type: ignore[attr-defined]
    assert len(attempts) == 3
    assert all(a.status is None and a.error for a in attempts)


def test_many_threads_share_one_wrapped_client(server: tuple[str, Behaviour]) -> None:
    url, b = server
    b.rejections = 1
    events: list[RetryEvent] = []
    client = llm_backoff.wrap(openai.OpenAI(api_key="sk-test", base_url=f"{url}/v1"), on_retry=events.append)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            r = client.chat.completions.create(
                model="m", messages=MESSAGES, extra_headers={"x-caller": f"t{i}"}
            )
            assert r.choices[0].message.content == "hello world"
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(b.seen) == 16
    assert len(events) == 8


async def test_async_client_retries_and_streams(server: tuple[str, Behaviour]) -> None:
    url, b = server
    events: list[RetryEvent] = []
    client = llm_backoff.wrap(
        openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1"), on_retry=events.append
    )
    result = await client.chat.completions.create(
        model="m", messages=MESSAGES, extra_headers={"x-caller": "a"}
    )
    assert result.choices[0].message.content == "hello world"
    stream = await client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True, extra_headers={"x-caller": "b"}
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "hello world"
    assert len(b.seen) == 6
    assert [e.attempt for e in events] == [1, 2, 1, 2]
    await client.close()


async def test_async_gives_up_with_history(server: tuple[str, Behaviour]) -> None:
    url, b = server
    b.rejections = 100
    client = llm_backoff.wrap(
        openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1"), RetryPolicy(max_attempts=2)
    )
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(model="m", messages=MESSAGES)
    assert len(info.value.llm_backoff_attempts) == 2  # type: ignore[attr-defined]
    await client.close()


async def test_async_stream_cut_midway_raises_and_is_not_retried(server: tuple[str, Behaviour]) -> None:
    url, b = server
    b.rejections = 0
    client = llm_backoff.wrap(openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/cut/v1"))
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    received: list[str] = []
    chunks = stream.__aiter__()
    received.append((await chunks.__anext__()).choices[0].delta.content or "")
    received.append((await chunks.__anext__()).choices[0].delta.content or "")
    with pytest.raises(Exception) as info:  # noqa: PT011 - httpx and httpx2 name it differently
        await chunks.__anext__()
    assert cut_error(info.value)
    assert [a.status for a in info.value.llm_backoff_attempts] == [200]  # type: ignore[attr-defined]
    assert received == ["hello", " "]
    assert len(b.seen) == 1
    await client.close()


async def test_many_tasks_share_one_wrapped_async_client(server: tuple[str, Behaviour]) -> None:
    url, b = server
    b.rejections = 1
    client = llm_backoff.wrap(openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1"))

    async def one(i: int) -> str:
        r = await client.chat.completions.create(
            model="m", messages=MESSAGES, extra_headers={"x-caller": f"k{i}"}
        )
        return r.choices[0].message.content or ""

    results = await asyncio.gather(*(one(i) for i in range(20)))
    assert results == ["hello world"] * 20
    assert len(b.seen) == 40
    await client.close()


def test_closing_the_wrapped_client_leaves_the_given_one_usable(server: tuple[str, Behaviour]) -> None:
    url, b = server
    b.rejections = 0
    original = openai.OpenAI(api_key="sk-test", base_url=f"{url}/v1")
    wrapped = llm_backoff.wrap(original)
    assert wrapped.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
    wrapped.close()
    assert wrapped.is_closed()
    assert not original.is_closed()
    assert original.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
    # openai 3.x lets httpx2's RuntimeError through; 2.x wraps it in APIConnectionError
    with pytest.raises((RuntimeError, openai.APIConnectionError)):
        wrapped.chat.completions.create(model="m", messages=MESSAGES)
    original.close()


async def test_closing_the_wrapped_async_client_leaves_the_given_one_usable(
    server: tuple[str, Behaviour],
) -> None:
    url, b = server
    b.rejections = 0
    original = openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1")
    wrapped = llm_backoff.wrap(original)
    assert (await wrapped.chat.completions.create(model="m", messages=MESSAGES)).choices
    await wrapped.close()
    assert (await original.chat.completions.create(model="m", messages=MESSAGES)).choices
    await original.close()
