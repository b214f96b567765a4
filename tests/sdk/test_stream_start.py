"""A stream that fails before its first content is retried; after content it is raised.

Real openai and anthropic clients, sync and async, against a server on 127.0.0.1 that
opens its event streams with an error event (an OpenAI-style ``{"error": ...}`` chunk,
Anthropic's ``overloaded_error``) or cuts them before any content, and then streams
properly. Waits are skipped with ``instant_retries``; hints are still recorded. The
scanner that tells content from what comes before it is tested on its own at the end.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

import llm_backoff
from llm_backoff import RetryEvent, RetryPolicy
from llm_backoff.stream_start import MAX_OPENING, ErrorEvent, StreamStart
from llm_backoff.testing import instant_retries

anthropic = pytest.importorskip("anthropic")

MESSAGES: Any = [{"role": "user", "content": "hi"}]
CUT = "<cut>"
"""In a script: the server drops the connection here."""


def data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def chat(delta: dict[str, Any], finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return data(
        {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}
    )


ROLE = chat({"role": "assistant", "content": ""})
CHAT = [ROLE, chat({"content": "hello"}), chat({"content": " world"}), chat({}, "stop"), "data: [DONE]\n\n"]


def openai_error(code: object, **extra: Any) -> str:
    return data({"error": {"message": "server busy (test)", "type": "server_error", "code": code, **extra}})


def sse(event: str, payload: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(payload)}\n\n"


MESSAGE_START = sse(
    "message_start",
    {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 0},
        },
    },
)
PING = sse("ping", {"type": "ping"})
OVERLOADED = sse("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
MESSAGE = [
    MESSAGE_START,
    PING,
    sse(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    ),
    *(
        sse(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        )
        for text in ("hello", " world")
    ),
    sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
    sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 2},
        },
    ),
    sse("message_stop", {"type": "message_stop"}),
]


class Scripted:
    """Streams the scripts in turn (then ``last`` for every later request), with ``headers``."""

    def __init__(self, *scripts: list[str], last: list[str], headers: dict[str, str] | None = None) -> None:
        self.scripts = list(scripts)
        self.last = last
        self.headers = headers or {}
        self.calls = 0
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def answer(request: Request) -> Response:
            await request.body()
            with self.lock:
                self.calls += 1
                n = self.calls
            script = self.scripts[n - 1] if n <= len(self.scripts) else self.last

            async def events() -> AsyncIterator[str]:
                for item in script:
                    if item == CUT:
                        raise RuntimeError("connection dropped before any content (test)")
                    yield item

            return StreamingResponse(events(), media_type="text/event-stream", headers=self.headers)

        return Starlette(
            routes=[
                Route("/v1/chat/completions", answer, methods=["POST"]),
                Route("/v1/messages", answer, methods=["POST"]),
            ]
        )


@pytest.fixture
def start(serve: Callable[[Any], str]) -> Callable[..., tuple[Scripted, str]]:
    def started(*scripts: list[str], last: list[str] = CHAT, **options: Any) -> tuple[Scripted, str]:
        server = Scripted(*scripts, last=last, **options)
        return server, serve(server.app())

    return started


def openai_client(lib: ModuleType, url: str, *, is_async: bool = False, **options: Any) -> Any:
    """A wrapped openai client over ``lib`` (httpx2, or a legacy httpx client)."""
    if lib.__name__ == "httpx2" and not openai.__version__.startswith("3."):
        pytest.skip("openai 2.x takes httpx clients only")
    if is_async:
        return llm_backoff.wrap(
            openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1", http_client=lib.AsyncClient()),
            **options,
        )
    return llm_backoff.wrap(
        openai.OpenAI(api_key="sk-test", base_url=f"{url}/v1", http_client=lib.Client()), **options
    )


def text_of(chunks: Any) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def statuses(response: Any) -> list[int | None]:
    return [a.status for a in response.extensions["llm_backoff.attempts"]]


BEFORE_CONTENT = "before any content of a 200 event stream"


# -- openai ------------------------------------------------------------------------------


def test_an_error_chunk_before_content_is_retried_with_its_hint(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start([openai_error("queue_full", retry_after_seconds=0.25)])
    events: list[RetryEvent] = []
    client = openai_client(lib, url, on_retry=events.append)
    with instant_retries():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert text_of(stream) == "hello world"
    assert server.calls == 2
    assert [(e.reason, e.hint) for e in events] == [
        (f"status 503 (server_error event {BEFORE_CONTENT})", 0.25)
    ]
    assert statuses(stream.response) == [503, 200]


async def test_async_an_error_chunk_naming_a_rate_limit_is_retried_as_a_429(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    # a hint in the 200's own headers is the error event's hint
    server, url = start([openai_error("rate_limit_exceeded")], headers={"retry-after": "2"})
    events: list[RetryEvent] = []
    client = openai_client(lib, url, is_async=True, on_retry=events.append)
    with instant_retries():
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert text_of([c async for c in stream]) == "hello world"
    assert server.calls == 2
    assert [(e.reason.split(" (")[0], e.hint) for e in events] == [("status 429", 2.0)]
    assert statuses(stream.response) == [429, 200]
    await client.close()


def test_a_stream_cut_before_content_is_retried(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start([ROLE, CUT])
    events: list[RetryEvent] = []
    client = openai_client(lib, url, on_retry=events.append)
    with instant_retries():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert text_of(stream) == "hello world"
    assert server.calls == 2
    assert [e.reason for e in events] == ["connection error (RemoteProtocolError)"]
    assert statuses(stream.response) == [None, 200]


async def test_async_a_stream_that_ends_before_content_is_retried(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start([ROLE], [ROLE, CUT])
    client = openai_client(lib, url, is_async=True)
    with instant_retries():
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert text_of([c async for c in stream]) == "hello world"
    assert server.calls == 3
    attempts = stream.response.extensions["llm_backoff.attempts"]
    assert [a.status for a in attempts] == [None, None, 200]
    assert attempts[0].error == "RemoteProtocolError: the event stream ended before any content"
    await client.close()


def test_a_role_chunk_then_an_error_chunk_is_retried(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start([ROLE, ": keep-alive\n\n", openai_error(503)])
    client = openai_client(lib, url)
    with instant_retries():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert text_of(stream) == "hello world"
    assert server.calls == 2
    assert statuses(stream.response) == [503, 200]


def test_an_error_after_content_is_raised_not_retried_with_the_history(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start([ROLE, chat({"content": "hel"}), openai_error("queue_full")])
    client = openai_client(lib, url)
    received: list[str] = []
    with instant_retries():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError) as info:
            received.extend(chunk.choices[0].delta.content for chunk in stream)
    assert received == ["", "hel"]
    assert server.calls == 1
    assert [a.status for a in info.value.llm_backoff_attempts] == [200]  # type: ignore[attr-defined]
    assert "the stream failed after it had started; not retried" in "\n".join(info.value.__notes__)


def test_an_error_chunk_naming_a_bad_request_is_not_retried(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    # vLLM's shape: the HTTP status in "code"
    server, url = start([openai_error(400, type="BadRequestError")])
    client = openai_client(lib, url)
    with instant_retries(), pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert server.calls == 1
    assert [a.status for a in info.value.llm_backoff_attempts] == [400]  # type: ignore[attr-defined]


def test_errors_that_last_give_up_with_the_status_they_stand_for(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(last=[ROLE, openai_error("queue_full")])
    client = openai_client(lib, url, policy=RetryPolicy(max_attempts=3))
    with instant_retries(), pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    exc = info.value
    assert exc.status_code == 503
    assert exc.body == {"message": "server busy (test)", "type": "server_error", "code": "queue_full"}
    assert [a.status for a in exc.llm_backoff_attempts] == [503, 503, 503]  # type: ignore[attr-defined]
    assert "max_attempts (3) reached" in "\n".join(exc.__notes__)
    assert server.calls == 3


def test_cuts_that_last_give_up_with_a_connection_error(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(last=[ROLE, CUT])
    client = openai_client(lib, url, policy=RetryPolicy(max_attempts=2))
    with instant_retries(), pytest.raises(openai.APIConnectionError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert [a.status for a in info.value.llm_backoff_attempts] == [None, None]  # type: ignore[attr-defined]
    assert server.calls == 2


def test_a_hint_past_the_deadline_gives_up_at_once(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(last=[openai_error("queue_full", retry_after_seconds=30)])
    client = openai_client(lib, url, policy=RetryPolicy(deadline=5))
    with pytest.raises(openai.InternalServerError) as info:  # waits are real here: none is taken
        client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    attempts = info.value.llm_backoff_attempts  # type: ignore[attr-defined]
    assert [(a.status, a.hint, a.wait) for a in attempts] == [(503, 30.0, None)]
    assert "deadline" in "\n".join(info.value.__notes__)
    assert server.calls == 1


# -- anthropic ---------------------------------------------------------------------------


def test_anthropic_overloaded_event_before_content_is_retried(
    start: Callable[..., tuple[Scripted, str]],
) -> None:
    server, url = start([MESSAGE_START, PING, OVERLOADED], last=MESSAGE, headers={"retry-after-ms": "1500"})
    events: list[RetryEvent] = []
    client = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"), on_retry=events.append)
    with instant_retries():
        stream = client.messages.create(model="m", max_tokens=16, messages=MESSAGES, stream=True)
        texts = [e.delta.text for e in stream if e.type == "content_block_delta"]
    assert texts == ["hello", " world"]
    assert server.calls == 2
    assert [(e.reason, e.hint) for e in events] == [
        (f"status 529 (overloaded_error event {BEFORE_CONTENT})", 1.5)
    ]
    assert statuses(stream.response) == [529, 200]


async def test_async_anthropic_overloaded_event_before_content_is_retried(
    start: Callable[..., tuple[Scripted, str]],
) -> None:
    server, url = start([OVERLOADED], [MESSAGE_START, CUT], last=MESSAGE)
    client = llm_backoff.wrap(anthropic.AsyncAnthropic(base_url=url, api_key="k"))
    with instant_retries():
        stream = await client.messages.create(model="m", max_tokens=16, messages=MESSAGES, stream=True)
        texts = [e.delta.text async for e in stream if e.type == "content_block_delta"]
    assert texts == ["hello", " world"]
    assert server.calls == 3
    assert statuses(stream.response) == [529, None, 200]
    await client.close()


def test_anthropic_overload_that_lasts_raises_overloaded_error(
    start: Callable[..., tuple[Scripted, str]],
) -> None:
    server, url = start(last=[MESSAGE_START, OVERLOADED])
    client = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"), RetryPolicy(max_attempts=2))
    with instant_retries(), pytest.raises(anthropic.OverloadedError) as info:
        client.messages.create(model="m", max_tokens=16, messages=MESSAGES, stream=True)
    assert [a.status for a in info.value.llm_backoff_attempts] == [529, 529]
    assert server.calls == 2


def test_anthropic_error_after_content_is_raised_not_retried(
    start: Callable[..., tuple[Scripted, str]],
) -> None:
    server, url = start([*MESSAGE[:4], OVERLOADED])
    client = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"))
    texts: list[str] = []
    with instant_retries():
        stream = client.messages.create(model="m", max_tokens=16, messages=MESSAGES, stream=True)
        with pytest.raises(anthropic.APIStatusError) as info:
            texts.extend(event.delta.text for event in stream if event.type == "content_block_delta")
    assert texts == ["hello"]
    assert server.calls == 1
    assert [a.status for a in info.value.llm_backoff_attempts] == [200]


# -- what is content ---------------------------------------------------------------------


def scan(*chunks: bytes) -> ErrorEvent | bool | None:
    start = StreamStart()
    for chunk in chunks:
        verdict = start.feed(chunk)
        if verdict is not None:
            return verdict
    return None


def event(payload: dict[str, Any], name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(payload)}\n\n".encode()


@pytest.mark.parametrize(
    "opening",
    [
        ROLE.encode(),
        b": comment\n\nevent: ping\n\n",
        event({"choices": [], "prompt_filter_results": []}),
        event({"type": "response.created", "response": {}}, "response.created"),
        event({"type": "response.in_progress", "response": {}}, "response.in_progress"),
        MESSAGE_START.encode() + PING.encode(),
        event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ],
)
def test_what_comes_before_content(opening: bytes) -> None:
    assert scan(opening) is None


@pytest.mark.parametrize(
    "content",
    [
        chat({"content": "h"}).encode(),
        chat({"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f"}}]}).encode(),
        chat({"refusal": "no"}).encode(),
        chat({"reasoning_content": "hmm"}).encode(),
        chat({}, "stop").encode(),
        event({"choices": [], "usage": {"total_tokens": 1}}),
        event({"type": "response.output_text.delta", "delta": "h"}),
        event({"type": "response.output_item.added", "item": {}}),
        event({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "h"}}),
        event({"type": "content_block_start", "content_block": {"type": "tool_use", "name": "f"}}),
        b"data: [DONE]\n\n",
        b"data: not json\n\n",
    ],
)
def test_what_is_content(content: bytes) -> None:
    assert scan(ROLE.encode(), content) is True


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (OVERLOADED.encode(), 529),
        (event({"type": "error", "error": {"type": "rate_limit_error", "message": "x"}}, "error"), 429),
        (event({"type": "error", "error": {"type": "api_error", "message": "x"}}, "error"), 500),
        (openai_error("queue_full").encode(), 503),
        (openai_error(None).encode(), 503),
        (openai_error("429").encode(), 429),
        (openai_error(400).encode(), 400),
        (event({"error": {"message": "x", "type": "insufficient_quota"}}), 429),
        (event({"type": "response.failed", "response": {"error": {"code": "server_error"}}}), 503),
        (b"event: error\ndata: upstream went away\n\n", 503),
    ],
)
def test_error_events_stand_for_a_status(error: bytes, status: int) -> None:
    verdict = scan(ROLE.encode(), error)
    assert isinstance(verdict, ErrorEvent)
    assert verdict.status == status


def test_events_split_anywhere_are_read_whole() -> None:
    whole = b"event: ping\r\ndata: {}\r\n\r\n" + OVERLOADED.encode().replace(b"\n", b"\r\n")
    verdict = scan(*(whole[i : i + 1] for i in range(len(whole))))
    assert isinstance(verdict, ErrorEvent)
    assert verdict.status == 529
    assert scan(*(bytes([b]) for b in chat({"content": "h"}).encode())) is True


def test_a_long_opening_is_handed_over() -> None:
    assert scan(b": " + b"x" * MAX_OPENING + b"\n") is True


# -- at the transport --------------------------------------------------------------------


def transports(lib: ModuleType) -> tuple[type[Any], type[Any]]:
    from llm_backoff import transport

    if lib.__name__ == "httpx2":
        return transport.Httpx2RetryTransport, transport.AsyncHttpx2RetryTransport
    return transport.HttpxRetryTransport, transport.AsyncHttpxRetryTransport


SENT = [
    ROLE.encode()[:20],
    ROLE.encode()[20:] + b": keep-alive\n\n",
    chat({"content": "h"}).encode() + b"da",
    b"ta: [DONE]\n\n",
]


def sent_in_pieces(lib: ModuleType) -> Callable[[Any], Any]:
    def handler(request: Any) -> Any:
        return lib.Response(200, headers={"content-type": "text/event-stream"}, stream=Pieces(lib, SENT))

    return handler


def Pieces(lib: ModuleType, pieces: list[bytes]) -> Any:  # noqa: N802 - a class made per library
    class Stream(lib.SyncByteStream, lib.AsyncByteStream):  # type: ignore[misc, name-defined]
        def __iter__(self) -> Any:
            yield from pieces

        async def __aiter__(self) -> Any:
            for piece in pieces:
                yield piece

    return Stream()


def test_the_bytes_handed_over_are_those_sent(lib: ModuleType) -> None:
    sync_cls, _ = transports(lib)
    with (
        lib.Client(transport=sync_cls(lib.MockTransport(sent_in_pieces(lib)))) as client,
        client.stream("POST", "http://api/v1/chat/completions") as response,
    ):
        received = list(response.iter_raw())
    # what was read to the first content, in one piece, then the rest as it came
    assert received == [b"".join(SENT[:3]), SENT[3]]


async def test_async_the_bytes_handed_over_are_those_sent(lib: ModuleType) -> None:
    _, async_cls = transports(lib)
    async with (
        lib.AsyncClient(transport=async_cls(lib.MockTransport(sent_in_pieces(lib)))) as client,
        client.stream("POST", "http://api/v1/chat/completions") as response,
    ):
        received = [piece async for piece in response.aiter_raw()]
    assert received == [b"".join(SENT[:3]), SENT[3]]


@pytest.mark.parametrize(
    ("policy", "cut_at", "note"),
    [
        (RetryPolicy(deadline=10), 11.0, "deadline passed"),
        (RetryPolicy(deadline=30, start_deadline=5), 6.0, "start deadline passed before the answer began"),
    ],
)
def test_an_opening_without_content_is_cut_at_the_time_to_begin(
    lib: ModuleType, fake_time: Any, policy: RetryPolicy, cut_at: float, note: str
) -> None:
    """Events without content, a second apart, are read until the answer must have begun."""
    sync_cls, _ = transports(lib)

    def role_chunks() -> Any:
        for _ in range(50):
            fake_time.now += 1.0
            yield ROLE.encode()

    def handler(request: Any) -> Any:
        return lib.Response(200, headers={"content-type": "text/event-stream"}, stream=Slow(lib, role_chunks))

    transport = sync_cls(lib.MockTransport(handler), policy, **fake_time.engine_options())
    with lib.Client(transport=transport) as client, pytest.raises(lib.ReadTimeout) as info:
        client.post("http://api/v1/chat/completions")
    assert [a.status for a in info.value.llm_backoff_attempts] == [None]  # type: ignore[attr-defined]
    assert note in str(info.value)
    assert fake_time.now == 1000.0 + cut_at


def Slow(lib: ModuleType, chunks: Callable[[], Any]) -> Any:  # noqa: N802 - a class made per library
    class Stream(lib.SyncByteStream):  # type: ignore[misc, name-defined]
        def __iter__(self) -> Any:
            return chunks()

    return Stream()


def test_a_stream_left_after_its_first_content_is_closed(lib: ModuleType) -> None:
    sync_cls, _ = transports(lib)
    closed: list[str] = []

    def pieces() -> Any:
        try:
            yield from SENT
        finally:
            closed.append("read")

    def handler(request: Any) -> Any:
        stream = Closing(lib, pieces, closed)
        return lib.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)

    with (
        lib.Client(transport=sync_cls(lib.MockTransport(handler))) as client,
        client.stream("POST", "http://api/v1/chat/completions") as response,
    ):
        assert next(response.iter_raw()) == b"".join(SENT[:3])
    assert closed == ["read", "stream"]


def Closing(lib: ModuleType, chunks: Callable[[], Any], closed: list[str]) -> Any:  # noqa: N802
    class Stream(lib.SyncByteStream):  # type: ignore[misc, name-defined]
        def __iter__(self) -> Any:
            return chunks()

        def close(self) -> None:
            closed.append("stream")

    return Stream()
