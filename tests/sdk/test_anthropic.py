"""`wrap()` on the `anthropic` SDK's clients, against an Anthropic-shaped server on 127.0.0.1.

The server answers ``/v1/messages`` with Anthropic's error shape
(``{"type": "error", "error": {"type": "overloaded_error", "message": ...}}``): a 429
``rate_limit_error`` with ``retry-after``, a 529 ``overloaded_error`` with
``retry-after-ms``, then a message, plain or streamed as Anthropic's server-sent events.
Waits are skipped with ``instant_retries``; the hints are still recorded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import llm_backoff
from llm_backoff.testing import instant_retries

anthropic = pytest.importorskip("anthropic")

MESSAGES: Any = [{"role": "user", "content": "hi"}]
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "m",
    "content": [{"type": "text", "text": "hello world"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 3, "output_tokens": 2},
}


def error(kind: str, status: int, headers: dict[str, str]) -> Response:
    body = {"type": "error", "error": {"type": kind, "message": f"{kind} (test)"}}
    return JSONResponse(body, status_code=status, headers=headers)


RATE_LIMITED = ("rate_limit_error", 429, {"retry-after": "2"})
OVERLOADED = ("overloaded_error", 529, {"retry-after-ms": "1500"})
INVALID = ("invalid_request_error", 400, {})
NOT_FOUND = ("not_found_error", 404, {})


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


async def events() -> AsyncIterator[str]:
    start = {**MESSAGE, "content": [], "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
    yield sse("message_start", {"type": "message_start", "message": start})
    yield sse(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )
    for text in ("hello", " world"):
        delta = {"type": "text_delta", "text": text}
        yield sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
    yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 2},
        },
    )
    yield sse("message_stop", {"type": "message_stop"})


class Anthropicish:
    """Answers the errors in ``script`` in turn, then messages; keeps the headers of each request."""

    def __init__(self, script: list[tuple[str, int, dict[str, str]]]) -> None:
        self.script = script
        self.seen: list[dict[str, str]] = []
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def messages(request: Request) -> Response:
            body = await request.json()
            with self.lock:
                self.seen.append(dict(request.headers))
                n = len(self.seen)
            if n <= len(self.script):
                return error(*self.script[n - 1])
            if body.get("stream"):
                return StreamingResponse(events(), media_type="text/event-stream")
            return JSONResponse(MESSAGE)

        return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])


@pytest.fixture
def start(serve: Callable[[Any], str]) -> Callable[..., tuple[Anthropicish, str]]:
    def started(*script: tuple[str, int, dict[str, str]]) -> tuple[Anthropicish, str]:
        server = Anthropicish(list(script))
        return server, serve(server.app())

    return started


def test_429_and_529_are_ridden_out_with_their_hints(
    start: Callable[..., tuple[Anthropicish, str]],
) -> None:
    server, url = start(RATE_LIMITED, OVERLOADED)
    events_seen: list[llm_backoff.RetryEvent] = []
    original = anthropic.Anthropic(base_url=url, api_key="sk-ant", max_retries=5)
    wrapped = llm_backoff.wrap(original, on_retry=events_seen.append, request_class="batch")
    assert type(wrapped) is anthropic.Anthropic
    assert (wrapped.max_retries, original.max_retries) == (0, 5)
    with instant_retries():
        message = wrapped.messages.create(model="m", max_tokens=16, messages=MESSAGES)
    assert message.content[0].text == "hello world"
    assert [(e.reason, e.hint) for e in events_seen] == [("status 429", 2.0), ("status 529", 1.5)]
    assert len(server.seen) == 3
    # the key as this anthropic version sends it (``x-api-key``, or a bearer token), on every attempt
    keys = {seen.get("x-api-key") or seen["authorization"] for seen in server.seen}
    assert keys in ({"sk-ant"}, {"Bearer sk-ant"})
    assert {seen["x-request-class"] for seen in server.seen} == {"batch"}
    assert [seen["x-stainless-retry-count"] for seen in server.seen] == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("script", "error_name"), [(INVALID, "BadRequestError"), (NOT_FOUND, "NotFoundError")]
)
def test_other_4xx_are_not_retried_and_keep_anthropics_type(
    start: Callable[..., tuple[Anthropicish, str]], script: tuple[str, int, dict[str, str]], error_name: str
) -> None:
    server, url = start(script)
    wrapped = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"))
    with instant_retries(), pytest.raises(getattr(anthropic, error_name)) as caught:
        wrapped.messages.create(model="m", max_tokens=16, messages=MESSAGES)
    assert len(server.seen) == 1
    assert [a.status for a in caught.value.llm_backoff_attempts] == [script[1]]


def test_an_overload_that_lasts_raises_anthropics_error_with_the_history(
    start: Callable[..., tuple[Anthropicish, str]],
) -> None:
    server, url = start(*[OVERLOADED] * 3)
    policy = llm_backoff.RetryPolicy(max_attempts=3)
    wrapped = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"), policy)
    with instant_retries(), pytest.raises(anthropic.APIStatusError) as caught:
        wrapped.messages.create(model="m", max_tokens=16, messages=MESSAGES)
    exc = caught.value
    assert exc.status_code == 529
    assert type(exc).__module__.startswith("anthropic")
    assert exc.body["error"]["type"] == "overloaded_error"
    assert [a.status for a in exc.llm_backoff_attempts] == [529, 529, 529]
    assert "max_attempts (3) reached" in "\n".join(exc.__notes__)
    assert len(server.seen) == 3


def test_a_stream_is_retried_until_it_begins_and_then_read_whole(
    start: Callable[..., tuple[Anthropicish, str]],
) -> None:
    server, url = start(OVERLOADED, RATE_LIMITED)
    wrapped = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"))
    with instant_retries():
        stream = wrapped.messages.create(model="m", max_tokens=16, messages=MESSAGES, stream=True)
        texts = [e.delta.text for e in stream if e.type == "content_block_delta"]
    assert texts == ["hello", " world"]
    assert len(server.seen) == 3


def test_the_stream_helper_rides_out_an_overload(start: Callable[..., tuple[Anthropicish, str]]) -> None:
    server, url = start(OVERLOADED)
    wrapped = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"))
    with instant_retries(), wrapped.messages.stream(model="m", max_tokens=16, messages=MESSAGES) as stream:
        assert stream.get_final_text() == "hello world"
    assert len(server.seen) == 2


async def test_async_client_non_streaming_and_streaming(
    start: Callable[..., tuple[Anthropicish, str]],
) -> None:
    server, url = start(RATE_LIMITED, OVERLOADED)
    wrapped = llm_backoff.wrap(anthropic.AsyncAnthropic(base_url=url, api_key="k"))
    assert type(wrapped) is anthropic.AsyncAnthropic
    with instant_retries():
        message = await wrapped.messages.create(model="m", max_tokens=16, messages=MESSAGES)
        assert message.content[0].text == "hello world"
        stream = await wrapped.messages.create(model="m", max_tokens=16, messages=MESSAGES, stream=True)
        texts = [e.delta.text async for e in stream if e.type == "content_block_delta"]
    assert texts == ["hello", " world"]
    assert len(server.seen) == 4
    assert llm_backoff.client_stats(wrapped).retries == 2


def test_an_interactive_anthropic_client_fails_fast_on_a_long_hint(
    start: Callable[..., tuple[Anthropicish, str]],
) -> None:
    server, url = start(("overloaded_error", 529, {"retry-after": "30"}))
    wrapped = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"), request_class="interactive")
    with pytest.raises(anthropic.APIStatusError) as caught:
        wrapped.messages.create(model="m", max_tokens=16, messages=MESSAGES)
    assert "above max_retry_after (2 s)" in "\n".join(caught.value.__notes__)
    assert len(server.seen) == 1
