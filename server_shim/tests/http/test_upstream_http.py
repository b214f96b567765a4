"""The relay's HTTP/1.1 client against scripted loopback servers: framing, pooling, failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import uvloop

from llm_backoff_shim.http.upstream_http import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeoutError,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


@dataclass
class Server:
    port: int = 0
    connections: int = 0
    heads: list[bytes] = field(default_factory=list)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)


async def read_request(reader: asyncio.StreamReader, server: Server) -> bytes:
    """One request's head and (content-length) body; records the head."""
    head = await reader.readuntil(b"\r\n\r\n")
    server.heads.append(head)
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return await reader.readexactly(length) if length else b""


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    state = Server()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            await handler(reader, writer, state)
        except (asyncio.IncompleteReadError, ConnectionError):
            state.closed_by_client.set()
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def keep_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
    while True:
        body = await read_request(reader, server)
        writer.write(ok(b"echo:" + body, b"content-type: text/plain\r\n"))
        await writer.drain()


def first_then_second(step: asyncio.Event) -> Handler:
    """A chunked answer: ``first`` at once, ``second`` and the end once ``step`` is set."""

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await step.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()  # stay open: the connection is reusable

    return stream


async def body_of(pool: UpstreamPool, method: str = "POST", body: bytes = b"{}") -> tuple[int, bytes]:
    response = await pool.request(method, b"/v1/x?y=1", [(b"x-test", b"1")], body)
    try:
        return response.status, await response.read(1 << 20)
    finally:
        response.release()


async def test_request_head_and_keep_alive_reuse() -> None:
    async with serve(keep_answering) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}/base/")
        assert await body_of(pool, body=b"one") == (200, b"echo:one")
        assert await body_of(pool, body=b"two") == (200, b"echo:two")
        assert server.connections == 1  # the second request reused the pooled connection
        head = server.heads[0]
        assert head.startswith(b"POST /base/v1/x?y=1 HTTP/1.1\r\n")
        assert f"host: 127.0.0.1:{server.port}\r\n".encode() in head
        assert b"content-length: 3\r\n" in head
        assert b"x-test: 1\r\n" in head
        await pool.close()
        assert pool.idle_connections == 0


async def test_chunked_body_arrives_as_sent() -> None:
    step = asyncio.Event()

    async with serve(first_then_second(step)) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        response = await pool.request("POST", b"/v1/s", [], b"{}")
        assert response.status == 200
        assert (b"transfer-encoding", b"chunked") in response.headers
        assert await response.read_chunk() == b"first"  # before the rest was even sent
        assert not response.at_eof()
        step.set()
        assert await response.read_chunk() == b"second"
        assert await response.read_chunk() == b""
        assert response.at_eof()
        response.release()
        assert pool.idle_connections == 1
        await pool.close()


async def test_body_delimited_by_close_is_read_to_the_end_and_not_pooled() -> None:
    async def http10(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        await writer.drain()

    async with serve(http10) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        assert await body_of(pool) == (200, b"all of it")
        assert pool.idle_connections == 0


async def test_head_answer_has_no_body_whatever_its_length() -> None:
    async def head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with serve(head) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        assert await body_of(pool, "HEAD", b"") == (200, b"")
        assert b"content-length" not in server.heads[0]  # no body, no length
        assert pool.idle_connections == 0


async def test_informational_answer_is_skipped() -> None:
    async def hundred(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"done"))
        await writer.drain()
        await reader.read()

    async with serve(hundred) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        assert await body_of(pool) == (200, b"done")


async def test_malformed_answer_is_an_error_before_the_response() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"this is not http\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with serve(garbage) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        with pytest.raises(UpstreamError, match="malformed") as caught:
            await body_of(pool)
        assert caught.value.before_response
        assert pool.idle_connections == 0


async def test_refused_connection_is_a_connect_error() -> None:
    async with serve(keep_answering) as server:
        port = server.port
    pool = UpstreamPool(f"http://127.0.0.1:{port}")  # nothing listens there any more
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await body_of(pool)


async def test_silence_beyond_the_read_timeout_fails_the_exchange() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        await reader.read()  # never answers; returns when the client closes
        server.closed_by_client.set()

    async with serve(mute) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}", read_timeout=0.2)
        with pytest.raises(UpstreamTimeoutError, match="silent"):
            await body_of(pool)
        await asyncio.wait_for(server.closed_by_client.wait(), 5)  # the connection was dropped


async def test_stale_pooled_connection_is_replaced_without_an_error() -> None:
    async def one_per_connection(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server
    ) -> None:
        body = await read_request(reader, server)
        writer.write(ok(b"echo:" + body))  # says keep-alive, then closes: the idle-close race
        await writer.drain()

    async with serve(one_per_connection) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        assert await body_of(pool, body=b"a") == (200, b"echo:a")
        await asyncio.sleep(0.05)  # the server's close reaches the pooled connection
        assert await body_of(pool, body=b"b") == (200, b"echo:b")
        assert server.connections == 2
        assert len(server.heads) == 2  # sent once each: nothing duplicated


async def test_failure_mid_body_is_not_a_before_response_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.transport.abort()

    async with serve(cut) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        response = await pool.request("POST", b"/v1/x", [], b"{}")
        assert await response.read_chunk() == b"partial"
        with pytest.raises(UpstreamError) as caught:
            await response.read_chunk()
        assert not caught.value.before_response
        response.release()
        assert pool.idle_connections == 0


async def test_release_mid_body_closes_the_connection_so_the_upstream_sees_the_abort() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"4\r\ntick\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async with serve(endless) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        response = await pool.request("POST", b"/v1/x", [], b"{}")
        assert (await response.read_chunk()).startswith(b"tick")
        response.release()
        await asyncio.wait_for(server.closed_by_client.wait(), 5)
        assert pool.idle_connections == 0


async def test_a_slow_reader_pauses_the_upstream_socket() -> None:
    payload = b"x" * (4 << 20)

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload))
        writer.write(payload)
        await writer.drain()
        await reader.read()

    async with serve(big) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        response = await pool.request("POST", b"/v1/x", [], b"{}")
        await asyncio.sleep(0.3)  # nobody reads: buffering must stop near the high-water mark
        assert response.buffered < len(payload) // 2
        received = b""
        while chunk := await response.read_chunk():
            received += chunk
        assert received == payload  # reading resumed and nothing was lost
        response.release()


async def test_a_caller_cancelled_while_waiting_for_the_head_leaves_no_error_behind() -> None:
    # The client left while the engine had not answered yet: the connection is dropped, and
    # its later connection_lost must not raise into the event loop.
    errors: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    got_request = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        got_request.set()
        await reader.read()
        server.closed_by_client.set()

    async with serve(silent) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        waiting = asyncio.create_task(pool.request("POST", b"/v1/x", [], b"{}"))
        await asyncio.wait_for(got_request.wait(), 5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(server.closed_by_client.wait(), 5)
        for _ in range(3):
            await asyncio.sleep(0)  # let connection_lost run
        assert errors == []
        assert pool.idle_connections == 0


async def test_pipe_hands_each_chunk_over_as_it_arrives_and_ends_with_the_body() -> None:
    step = asyncio.Event()

    async with serve(first_then_second(step)) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        response = await pool.request("POST", b"/v1/s", [], b"{}")
        got: list[bytes] = []

        def sink(chunk: bytes) -> bool:
            got.append(chunk)
            step.set()  # the rest is sent only once the first chunk was handed over
            return True

        assert await response.pipe(sink) is True
        assert got == [b"first", b"second"]
        assert response.at_eof()
        response.release()
        assert pool.idle_connections == 1
        await pool.close()


async def test_pipe_stops_when_the_sink_says_so_and_resumes_where_it_stopped() -> None:
    chunks = [b"%03d" % i for i in range(200)]

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for chunk in chunks:
            writer.write(b"3\r\n%s\r\n" % chunk)
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with serve(stream) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        response = await pool.request("POST", b"/v1/s", [], b"{}")
        got: list[bytes] = []
        accept = 0

        def sink(chunk: bytes) -> bool:
            got.append(chunk)
            return len(got) < accept

        stops = 0
        while True:
            accept = len(got) + 7  # a receiver that is "slow" every seventh chunk
            if await response.pipe(sink):
                break
            stops += 1
        assert stops > 0
        assert b"".join(got) == b"".join(chunks)  # in order, nothing lost or repeated
        response.release()
        assert pool.idle_connections == 1
        await pool.close()


async def test_pipe_raises_when_the_upstream_fails_mid_body() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\ntick\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async with serve(cut) as server:
        pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
        response = await pool.request("POST", b"/v1/x", [], b"{}")
        got: list[bytes] = []
        with pytest.raises(UpstreamError) as caught:
            await response.pipe(lambda chunk: got.append(chunk) is None)
        assert got == [b"tick"]
        assert not caught.value.before_response
        response.release()
        assert pool.idle_connections == 0


def test_works_on_uvloop() -> None:
    async def main() -> None:
        async with serve(keep_answering) as server:
            pool = UpstreamPool(f"http://127.0.0.1:{server.port}")
            assert await body_of(pool, body=b"u") == (200, b"echo:u")
            assert await body_of(pool, body=b"v") == (200, b"echo:v")
            assert server.connections == 1
            await pool.close()

    uvloop.run(main())


def test_rejects_a_base_url_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        UpstreamPool("ftp://example")
