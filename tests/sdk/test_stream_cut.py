"""A streamed answer that breaks after it started: raised, never retried, but with the history.

The transport passes event streams (and other unbuffered bodies) through unread; the
error raised while the caller reads one carries ``llm_backoff_attempts`` and a note like
any final error. openai 3.x wraps that error in ``APIConnectionError``, which gets the
history too. The loopback variant (a real server cutting its stream) is in
``test_wrap_e2e.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

import openai
import pytest

import llm_backoff
from llm_backoff.testing import instant_retries

OPENAI3 = openai.__version__.startswith("3.")

CHUNK = (
    b'data: {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m", '
    b'"choices": [{"index": 0, "delta": {"content": "hel"}, "finish_reason": null}]}\n\n'
)


class Server:
    """429 ``busy`` times, then a 200 event stream that breaks after one event."""

    def __init__(self, lib: ModuleType, broken_stream: Callable[..., Any], busy: int = 1) -> None:
        self.lib = lib
        self.broken_stream = broken_stream
        self.busy = busy
        self.calls = 0
        self.streams: list[Any] = []

    def __call__(self, request: Any) -> Any:
        self.calls += 1
        if self.calls <= self.busy:
            return self.lib.Response(
                429, headers={"retry-after-ms": "1"}, json={"error": {"message": "busy"}}
            )
        cut = self.lib.RemoteProtocolError("peer closed connection mid-stream")
        stream = self.broken_stream(self.lib, [CHUNK], cut)
        self.streams.append(stream)
        return self.lib.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)


def transports(lib: ModuleType) -> tuple[type[Any], type[Any]]:
    from llm_backoff import transport

    if lib.__name__ == "httpx2":
        return transport.Httpx2RetryTransport, transport.AsyncHttpx2RetryTransport
    return transport.HttpxRetryTransport, transport.AsyncHttpxRetryTransport


async def read_into(items: AsyncIterator[Any], received: list[Any]) -> None:
    async for item in items:
        received.append(item)


def check_history(exc: BaseException, statuses: list[int]) -> None:
    attempts = exc.llm_backoff_attempts  # type: ignore[attr-defined]
    assert [a.status for a in attempts] == statuses
    notes = "\n".join(getattr(exc, "__notes__", []))
    assert f"llm_backoff: {len(statuses)} attempt" in notes
    assert "broke off after it had started" in notes


def test_transport_cut_carries_the_history_and_is_not_retried(
    lib: ModuleType, broken_stream: Callable[..., Any]
) -> None:
    server = Server(lib, broken_stream, busy=1)
    sync_cls, _ = transports(lib)
    with (
        instant_retries(),
        lib.Client(transport=sync_cls(lib.MockTransport(server))) as client,
        client.stream("POST", "http://api/v1/chat", json={"stream": True}) as response,
    ):
        chunks = response.iter_bytes()
        assert next(chunks) == CHUNK
        with pytest.raises(lib.RemoteProtocolError) as info:
            next(chunks)
    check_history(info.value, [429, 200])
    assert server.calls == 2
    assert server.streams[0].closed


async def test_async_transport_cut_carries_the_history_and_is_not_retried(
    lib: ModuleType, broken_stream: Callable[..., Any]
) -> None:
    server = Server(lib, broken_stream, busy=2)
    _, async_cls = transports(lib)
    async with lib.AsyncClient(transport=async_cls(lib.MockTransport(server))) as client:
        with instant_retries():
            async with client.stream("POST", "http://api/v1/chat", json={"stream": True}) as response:
                received: list[bytes] = []
                with pytest.raises(lib.RemoteProtocolError) as info:
                    await read_into(response.aiter_bytes(), received)
    assert received == [CHUNK]
    check_history(info.value, [429, 429, 200])
    assert server.calls == 3
    assert server.streams[0].closed


def test_an_unbroken_stream_reads_as_before(lib: ModuleType) -> None:
    sync_cls, _ = transports(lib)

    def handler(request: Any) -> Any:
        return lib.Response(200, headers={"content-type": "text/event-stream"}, stream=lib.ByteStream(CHUNK))

    with (
        lib.Client(transport=sync_cls(lib.MockTransport(handler))) as client,
        client.stream("GET", "http://api/x") as response,
    ):
        assert b"".join(response.iter_bytes()) == CHUNK
        assert len(response.extensions["llm_backoff.attempts"]) == 1


@pytest.fixture
def http(lib: ModuleType) -> ModuleType:
    if lib.__name__ == "httpx2" and not OPENAI3:
        pytest.skip("openai 2.x takes httpx clients only")
    return lib


def openai_cut_error(http: ModuleType) -> tuple[type[BaseException], ...]:
    # Recent openai 3.x turns an HTTP error mid-stream into APIConnectionError; 2.x and the
    # first 3.x releases let it through.
    if OPENAI3:
        return (openai.APIConnectionError, http.RemoteProtocolError)
    return (http.RemoteProtocolError,)


def test_openai_stream_cut_carries_the_history(http: ModuleType, broken_stream: Callable[..., Any]) -> None:
    server = Server(http, broken_stream, busy=1)
    client = llm_backoff.wrap(
        openai.OpenAI(
            api_key="sk-test",
            base_url="http://llm.test/v1",
            http_client=http.Client(transport=http.MockTransport(server)),
        )
    )
    with instant_retries():
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.content == "hel"
    with pytest.raises(openai_cut_error(http)) as info:
        next(chunks)
    check_history(info.value, [429, 200])
    assert server.calls == 2


async def test_async_openai_stream_cut_carries_the_history(
    http: ModuleType, broken_stream: Callable[..., Any]
) -> None:
    server = Server(http, broken_stream, busy=0)
    client = llm_backoff.wrap(
        openai.AsyncOpenAI(
            api_key="sk-test",
            base_url="http://llm.test/v1",
            http_client=http.AsyncClient(transport=http.MockTransport(server)),
        )
    )
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=True
    )
    received: list[Any] = []
    with pytest.raises(openai_cut_error(http)) as info:
        await read_into(stream, received)
    received = [chunk.choices[0].delta.content for chunk in received]
    assert received == ["hel"]
    check_history(info.value, [200])
    assert server.calls == 1
    await client.close()
