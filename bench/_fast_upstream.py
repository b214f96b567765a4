"""A fast fake engine for the proxy benchmark: fixed JSON at once, or paced SSE.

    python bench/_fast_upstream.py --port 8001

Any request gets a fixed ~300-byte chat-completion JSON at once, unless it carries
``x-bench-chunks: N``: then the answer is an SSE stream of N token events plus
``data: [DONE]``, one event per write, ``x-bench-rate`` events per second (absolute
schedule, so the average rate holds even when the loop runs late). ``GET /health``
answers 200.

Hand-written on asyncio protocols and httptools instead of an ASGI app because this
process shares a core with the load generator: an ASGI app under uvicorn costs several
times more CPU per request and per event, and the benchmark would then measure the
fake engine rather than the proxies in front of it. It is loopback-only test
equipment: no pipelining, no request-body limits, no TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import cast

import httptools
import uvloop

_JSON_BODY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok " * 40},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 40, "total_tokens": 48},
    },
    separators=(",", ":"),
).encode()

_JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_JSON_BODY)).encode()
    + b"\r\n\r\n"
    + _JSON_BODY
)
_HEALTH_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


_EVENT = _chunk(
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
)
_DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class _Stream:
    """One paced SSE response; each event is written by its own timer callback."""

    def __init__(self, conn: _Connection, chunks: int, rate: float) -> None:
        self.conn = conn
        self.left = chunks
        self.gap = 1.0 / rate if rate > 0 else 0.0
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.start = loop.time()
        self.sent = 0
        conn.transport.write(_SSE_HEAD)
        self._next()

    def _next(self) -> None:
        if self.conn.closed:
            return
        if self.left == 0:
            self.conn.transport.write(_DONE)
            self.conn.stream = None
            self.conn.resume()
            return
        self.sent += 1
        self.loop.call_at(self.start + self.sent * self.gap, self._emit)

    def _emit(self) -> None:
        if self.conn.closed:
            return
        self.conn.transport.write(_EVENT)
        self.left -= 1
        self._next()


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport
        self.closed = False
        self.stream: _Stream | None = None
        self.url = b""
        self.chunks = 0
        self.rate = 0.0
        self.pending: list[bytes] = []

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        if self.stream is not None:
            self.pending.append(data)  # a request sent before the stream ended: parse it afterwards
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def resume(self) -> None:
        pending, self.pending = self.pending, []
        for data in pending:
            self.data_received(data)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.chunks, self.rate = b"", 0, 0.0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"x-bench-chunks":
            self.chunks = int(value)
        elif lowered == b"x-bench-rate":
            self.rate = float(value)

    def on_message_complete(self) -> None:
        if self.url == b"/health":
            self.transport.write(_HEALTH_RESPONSE)
        elif self.chunks > 0:
            self.stream = _Stream(self, self.chunks, self.rate)
        else:
            self.transport.write(_JSON_RESPONSE)


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Connection, host, port, backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
