"""The request/response cycle of a ``/v1/`` request: uvicorn's, minus what the relay never needs.

uvicorn's ``RequestResponseCycle`` serves any ASGI app, so every response pays for
checks a trusted caller does not need: two regular-expression searches per header,
the access-log test, a copy of the default headers, the message-type checks of
arbitrary apps. The relay is one known app, and its cost per request is what bounds
the shim's requests/s. This cycle keeps the same ASGI
``send``/``receive`` contract and the same state attributes uvicorn's protocol reads
and writes (``disconnected``, ``keep_alive``, ``body``, ``more_body``,
``message_event``, ``response_complete``, ...), so the protocol's keep-alive,
pipelining, flow control and shutdown work unchanged around it.

What it keeps from uvicorn's, because the wire depends on it: a header line can never
carry CR or LF (checked once over the whole head, not per header), content-length is
enforced in both directions, HEAD answers carry no body, a response without a length
is chunked, ``connection: close`` is honoured, and an app that fails before
answering gets a 500. An answer started before the request's body has all arrived closes
the connection after it (``connection: close``), as nginx does with a body it did not read;
like nginx's lingering close, the rest of that body is read and dropped first (``read_past``,
the protocol's): a socket closed with unread bytes is reset, and the reset can reach the
client before the answer.

What it adds: a start message carrying ``BODY_FOLLOWS: True`` promises that a body
message follows at once, and its head is written together with the first body bytes.
On loopback each write runs the whole TCP path and the client handles one more
segment: a relayed request costs two writes instead of three (strace), a 429 one
instead of two. A stream's head is never held (its first token may be seconds away);
the relay writes a held head itself (:meth:`flush_head`) before writing around ``send``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from llm_backoff_shim.http.errors import closing_error
from llm_backoff_shim.http.interface import BODY_FOLLOWS, STATUS_LINE, wire_answer

__all__ = ["BODY_FOLLOWS", "RelayCycle", "wire_answer"]

_ERROR_500 = closing_error(500, "internal error in the shim", "internal", kind="server_error")


def _nothing() -> None:
    pass


class RelayCycle:
    """One request's cycle; the attributes are the ones uvicorn's httptools protocol uses."""

    __slots__ = (
        "_held",
        "body",
        "chunked_encoding",
        "disconnected",
        "expected_content_length",
        "flow",
        "keep_alive",
        "logger",
        "message_event",
        "more_body",
        "on_response",
        "read_past",
        "response_complete",
        "response_started",
        "scope",
        "transport",
        "waiting_for_100_continue",
    )

    def __init__(
        self,
        scope: dict[str, Any],
        transport: asyncio.Transport,
        flow: Any,  # uvicorn's FlowControl: write_paused, drain(), resume_reading()
        logger: logging.Logger,
        *,
        expect_100_continue: bool,
        keep_alive: bool,
        on_response: Callable[[], None],
        read_past: Callable[[], None] | None = None,
    ) -> None:
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self.logger = logger
        self.message_event = asyncio.Event()
        self.on_response = on_response
        # Closing a connection whose request body is not all in: the protocol reads the rest
        # past, then closes (None: closed at once).
        self.read_past = read_past
        self.disconnected = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.body = bytearray()
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding: bool | None = None
        self.expected_content_length = 0
        self._held: bytes | None = None

    async def run_asgi(self, app: Callable[..., Any]) -> None:
        """Run the app for this request (the signature uvicorn's protocol calls)."""
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            self._fail()
        else:
            if not self.response_complete and not self.disconnected:
                self.logger.error("ASGI callable returned without completing its response.")
                self._fail()
        finally:
            self.on_response = _nothing

    def _fail(self) -> None:
        if self.response_started or self.transport.is_closing():
            self.transport.close()  # a half-sent answer must not pass for a complete one
            return
        self.response_started = self.response_complete = True
        self.transport.write(_ERROR_500)
        self.transport.close()

    async def receive(self) -> dict[str, Any]:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            if self.more_body and not self.body:
                self.flow.resume_reading()
                await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message = {"type": "http.request", "body": bytes(self.body), "more_body": self.more_body}
        self.body = bytearray()
        return message

    async def send(self, message: dict[str, Any]) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            self._start(message)
            return
        if self.response_complete:
            raise RuntimeError(f"ASGI message {message['type']!r} sent after the response completed")
        body: bytes = message.get("body", b"")
        more_body: bool = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            data = b""
            self.expected_content_length = 0
        elif self.chunked_encoding:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more_body:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            data = body
        held = self._held
        if held is not None:
            self._held = None
            data = held + data
        if data:
            self.transport.write(data)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                if self.more_body and self.read_past is not None:
                    self.read_past()
                else:
                    self.transport.close()
            self.on_response()

    def _start(self, message: dict[str, Any]) -> None:
        if message["type"] != "http.response.start":
            raise RuntimeError(f"expected 'http.response.start', got {message['type']!r}")
        self.response_started = True
        self.waiting_for_100_continue = False
        status: int = message["status"]
        headers = message.get("headers", ())
        if self.more_body:
            # Answered before the request's body was all received (a refusal from its head):
            # the rest is never parsed as a next request, the connection ends with this answer.
            self.keep_alive = False
        content = [STATUS_LINE[status]]
        close = False
        for name, value in headers:
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value)
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in (t.strip() for t in value.lower().split(b",")):
                self.keep_alive = False
                close = True
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not close:
            content.append(b"connection: close\r\n")
        if self.chunked_encoding is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        head = b"".join(content)
        # Every line of the head ends in CRLF; one more CR or LF anywhere is a header
        # carrying its own line break (response splitting), refused as uvicorn refuses it.
        lines = len(content) - len(headers) * 3
        if head.count(b"\n") != lines or head.count(b"\r") != lines:
            raise RuntimeError("Invalid HTTP header: CR or LF in a header name or value.")
        if message.get(BODY_FOLLOWS):
            self._held = head
        else:
            self.transport.write(head)

    def flush_head(self) -> None:
        """Write a held head now (before writing around ``send``, as the relay's direct path does)."""
        held = self._held
        if held is not None:
            self._held = None
            self.transport.write(held)
