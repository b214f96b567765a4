"""The relay's request cycle: what reaches the socket, write by write.

The cycle is driven here through its ASGI ``send``/``receive`` with a transport that
records each write (end-to-end behaviour is covered by every proxy test, which runs
serve's protocol, and by test_relay_protocol.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from uvicorn.protocols.http.flow_control import FlowControl

from llm_backoff_shim.http.relay_cycle import BODY_FOLLOWS, RelayCycle


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def cycle(
    transport: RecordingTransport,
    *,
    keep_alive: bool = True,
    done: list[bool] | None = None,
    method: str = "POST",
) -> RelayCycle:
    """A cycle as the relay protocol makes one; ``done`` records its end-of-response callback."""
    ended = done if done is not None else []
    return RelayCycle(
        {"type": "http", "method": method, "path": "/v1/x", "http_version": "1.1"},
        transport,  # type: ignore[arg-type]
        FlowControl(transport),  # type: ignore[arg-type]
        logging.getLogger("test"),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: ended.append(True),
    )


def start(status: int = 200, *, follows: bool, length: int | None = 5) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    message: dict[str, Any] = {"type": "http.response.start", "status": status, "headers": headers}
    if follows:
        message[BODY_FOLLOWS] = True
    return message


async def test_a_promised_body_goes_out_in_the_same_write_as_the_head() -> None:
    transport = RecordingTransport()
    done: list[bool] = []
    c = cycle(transport, done=done)
    await c.send(start(follows=True))
    assert transport.writes == []  # held until the body
    await c.send({"type": "http.response.body", "body": b"hello"})
    assert len(transport.writes) == 1
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-length: 5" in head
    assert body == b"hello"
    assert c.response_complete
    assert done == [True]


async def test_without_the_promise_the_head_is_written_at_once() -> None:
    transport = RecordingTransport()
    c = cycle(transport)
    await c.send(start(follows=False))
    assert len(transport.writes) == 1
    assert transport.writes[0].endswith(b"\r\n\r\n")
    await c.send({"type": "http.response.body", "body": b"hello"})
    assert transport.writes[1] == b"hello"


async def test_a_held_head_precedes_a_stream_and_its_end() -> None:
    transport = RecordingTransport()
    c = cycle(transport)
    await c.send(start(follows=True, length=None))
    await c.send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await c.send({"type": "http.response.body", "body": b"", "more_body": False})
    first = transport.writes[0]
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n" in first
    assert transport.writes[1:] == [b"0\r\n\r\n"]


async def test_a_closing_answer_writes_head_and_body_before_closing() -> None:
    transport = RecordingTransport()
    c = cycle(transport, keep_alive=False)
    await c.send(start(429, follows=True))
    await c.send({"type": "http.response.body", "body": b"nope!"})
    assert len(transport.writes) == 1
    assert transport.writes[0].startswith(b"HTTP/1.1 429 ")
    assert transport.writes[0].endswith(b"nope!")
    assert transport.closed


async def test_a_body_longer_than_its_length_is_refused_and_the_connection_closed() -> None:
    transport = RecordingTransport()
    c = cycle(transport)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(start(follows=True, length=2))
        await send({"type": "http.response.body", "body": b"too long"})

    await c.run_asgi(app)
    assert transport.closed
    assert all(b"too long" not in write for write in transport.writes)


async def test_a_header_carrying_a_line_break_is_refused() -> None:
    for name, value in ((b"x-evil", b"a\r\nset-cookie: 1"), (b"x-evil", b"a\nb"), (b"x-ev\ril", b"v")):
        transport = RecordingTransport()
        c = cycle(transport)
        with pytest.raises(RuntimeError, match="CR or LF"):
            await c.send({"type": "http.response.start", "status": 200, "headers": [(name, value)]})
        assert transport.writes == []


async def test_an_app_failing_before_its_answer_gets_a_500_and_a_closed_connection() -> None:
    transport = RecordingTransport()
    done: list[bool] = []
    c = cycle(transport, done=done)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise ValueError("boom")

    await c.run_asgi(app)
    assert len(transport.writes) == 1
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ")
    assert f"content-length: {len(body)}".encode() in head
    assert b'"type":"server_error"' in body
    assert transport.closed


async def test_an_app_failing_mid_answer_closes_the_connection_without_a_second_head() -> None:
    transport = RecordingTransport()
    c = cycle(transport)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(start(follows=False, length=None))
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise ValueError("boom")

    await c.run_asgi(app)
    assert transport.closed
    assert sum(write.count(b"HTTP/1.1") for write in transport.writes) == 1


async def test_a_head_answer_has_no_body_and_receive_returns_the_request_body() -> None:
    transport = RecordingTransport()
    c = cycle(transport, method="HEAD")
    c.body += b"abc"
    c.more_body = False
    assert await c.receive() == {"type": "http.request", "body": b"abc", "more_body": False}
    await c.send(start(follows=True, length=5))
    await c.send({"type": "http.response.body", "body": b"hello"})
    assert len(transport.writes) == 1
    assert transport.writes[0].endswith(b"\r\n\r\n")
    assert await c.receive() == {"type": "http.disconnect"}


async def test_flush_head_writes_a_held_head_once() -> None:
    transport = RecordingTransport()
    c = cycle(transport)
    await c.send(start(follows=True, length=None))
    c.flush_head()
    c.flush_head()
    assert len(transport.writes) == 1
    assert transport.writes[0].endswith(b"\r\n\r\n")
