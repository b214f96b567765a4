"""The relay's HTTP/1.1 client to the engine: pooled keep-alive connections on asyncio + httptools.

(Over 400 lines: one client whose connection, response and pool call into each other on every
byte received; a third of the file is the contract stated here.)

Why hand-written rather than aiohttp (which the shim still uses for its control-plane
requests: readiness probes and engine-metrics scrapes). The relay makes one upstream
request per proxied request, and the shim's throughput on one core is bounded by CPU
per request. ``bench/bench_proxy.py`` measured a bare uvicorn relay on aiohttp at about
310 us of CPU per request against about 80 us for uvicorn alone; aiohttp's general
machinery (request and response objects, a ``StreamReader`` per response, timer
handles re-armed on every read, cookie, redirect and proxy handling) is most of the
difference, and none of it is needed to talk to one known upstream. This client does
only what the relay needs:

- one pool of idle keep-alive connections to one host, reused last-in first-out and
  never kept longer than ``keepalive`` seconds idle, below the upstream's own idle
  timeout (uvicorn, which vLLM uses, closes idle connections after 5 s) so a request
  is not sent on a socket the upstream is closing;
- no pool limit (admission already caps generation requests; a pool cap would be a
  second, hidden queue), a connect timeout, and a read timeout: a response silent for
  ``read_timeout`` seconds fails, and an event stream (``text/event-stream``) silent for
  ``stream_read_timeout`` seconds once its first event has arrived (a healthy stream sends
  an event every few tens of milliseconds; only the wait for its first one, the prompt's
  prefill, can legitimately last as long as a whole non-streaming answer). One sweep per
  pool checks every exchange a few times
  per timeout period (at least once a second), because a timer per request, armed and
  cancelled, cost about 15 us of CPU per request here (a quarter of this client's cost);
- the request is written in one piece (head and the already buffered body); the
  response body is decoded from chunked framing by httptools and handed over as it
  arrives, with everything that arrived since the last read joined into one chunk;
  reading from the engine pauses when the client falls more than ``_HIGH_WATER``
  bytes behind;
- a request sent on a *reused* connection that fails before any response byte arrives
  is sent once more on a new connection: that is the race with the upstream closing
  an idle connection, and the upstream never saw the request. Any other failure is
  reported to the caller, never retried here.

Loopback test equipment aside, it is used only against the configured upstream; TLS
works through ``ssl`` for an ``https://`` upstream.
"""

from __future__ import annotations

import asyncio
import collections
import ssl as ssl_module
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import SplitResult, urlsplit

import httptools

#: Response bytes buffered for a slow client before the engine's socket stops being read.
_HIGH_WATER = 256 * 1024

#: Largest response head (status line and headers) accepted from the upstream, and most header
#: fields: past either the exchange fails with :class:`UpstreamProtocolError` (the relay answers
#: 502, as nginx and HAProxy do) before anything of it is relayed. A vLLM head is a few hundred
#: bytes; the limits keep a broken or hostile upstream from costing memory and CPU without bound
#: (httptools joins a header's pieces as they arrive, so a growing header costs quadratic time).
MAX_RESPONSE_HEAD_BYTES = 64 * 1024
MAX_RESPONSE_HEADERS = 100


class UpstreamError(Exception):
    """The upstream exchange failed; ``before_response`` tells whether any response had arrived."""

    def __init__(self, message: str, *, before_response: bool = True) -> None:
        super().__init__(message)
        self.before_response = before_response


class UpstreamConnectError(UpstreamError):
    """No connection could be opened (refused, unreachable, connect timeout)."""


class UpstreamTimeoutError(UpstreamError):
    """The upstream was silent for longer than the read timeout."""


class UpstreamProtocolError(UpstreamError):
    """The upstream's answer is not acceptable HTTP (malformed, or a head over the limits)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries at most one exchange at a time."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        read_timeout: float | None,
        on_closed: Callable[[_Connection], None],
        stream_read_timeout: float | None = None,
    ) -> None:
        self._loop = loop
        self._read_timeout = read_timeout
        self._stream_timeout = stream_read_timeout if stream_read_timeout is not None else read_timeout
        self._timeout = read_timeout  # the running exchange's silence limit
        self._events = False  # the response is an event stream still waiting for its first bytes
        self._on_closed = on_closed
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._parser: Any = None
        self._response: UpstreamResponse | None = None
        self._head: asyncio.Future[None] | None = None
        self._last_read = 0.0
        self.received = False
        self._head_bytes = -1  # bytes of the response head so far; -1 once the head is in
        self._head_tail = b""
        self._head_problem: str | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered as asyncio.Transport subclasses: no isinstance.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self._read_timeout is not None:
            self._last_read = self._loop.time()
        if self._parser is None:
            # Bytes while no exchange is running: the upstream broke the protocol; drop the connection.
            self._fail(UpstreamError("upstream sent data outside a response"))
            return
        counted = self._head_bytes
        if counted >= 0:
            # Judged before the parser joins the pieces: an oversized head is never built.
            total = counted + len(data)
            if total > MAX_RESPONSE_HEAD_BYTES:
                end = (self._head_tail + data).find(b"\r\n\r\n")
                if end < 0 or counted - len(self._head_tail) + end + 4 > MAX_RESPONSE_HEAD_BYTES:
                    self._fail(
                        UpstreamProtocolError(
                            f"upstream response head larger than {MAX_RESPONSE_HEAD_BYTES} bytes"
                        )
                    )
                    return
            self._head_bytes = total
            self._head_tail = data[-3:]
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            why = self._head_problem or f"malformed response from upstream: {exc}"
            self._fail(UpstreamProtocolError(why, before_response=not self._head_done))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_closed(self)
        response = self._response
        if response is not None and response.until_close and self._head_done and exc is None:
            self._message_complete()  # a body delimited by the connection's end (no length, not chunked)
            return
        reason = (
            f"upstream closed the connection ({type(exc).__name__})"
            if exc
            else "upstream closed the connection"
        )
        self._fail(UpstreamError(reason, before_response=not self._head_done))

    # -- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._response is not None
        headers = self._response.headers
        if len(headers) >= MAX_RESPONSE_HEADERS:
            self._head_problem = f"upstream response has more than {MAX_RESPONSE_HEADERS} header fields"
            raise UpstreamProtocolError(self._head_problem)  # stops the parser; reported by data_received
        headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._response
        assert response is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            response.headers.clear()  # an informational answer; the real one follows
            return
        response.status = status
        self._head_bytes = -1
        for name, value in response.headers:
            if name.lower() == b"content-type":
                self._events = response.event_stream = value.lower().startswith(b"text/event-stream")
        response.keep_alive = self._parser.should_keep_alive()
        if not response.keep_alive and status not in (204, 304):
            lowered = {name.lower() for name, _ in response.headers}
            response.until_close = b"content-length" not in lowered and b"transfer-encoding" not in lowered
        head = self._head
        if head is not None and not head.done():
            head.set_result(None)
        if response.method_head:
            # A HEAD answer has no body whatever its length says; end here and do not reuse.
            response.keep_alive = False
            self._message_complete()

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response is None:
            return
        if self._events:
            self._events = False
            self._timeout = self._stream_timeout  # between events from now on
        response.feed(body)
        if response.buffered > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._response is not None and self._head_done:
            self._message_complete()

    # -- exchange ----------------------------------------------------------------------------
    @property
    def _head_done(self) -> bool:
        head = self._head
        # Cancelled: the caller gave up waiting (client gone); no response was relayed.
        return head is not None and head.done() and not head.cancelled() and head.exception() is None

    def start(self, payload: bytes, response: UpstreamResponse) -> asyncio.Future[None]:
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._response = response
        self.received = False
        self._head_bytes = 0
        self._head_tail = b""
        self._head_problem = None
        self._timeout = self._read_timeout
        self._events = False
        self._head = self._loop.create_future()
        if self._read_timeout is not None:
            self._last_read = self._loop.time()
        self.transport.write(payload)
        return self._head

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def check_silence(self, now: float) -> None:
        """Fail the running exchange when the upstream has been silent for the read timeout."""
        timeout = self._timeout
        if self._parser is not None and timeout is not None and now - self._last_read >= timeout:
            why = f"upstream silent for {timeout:g} s"
            self._fail(UpstreamTimeoutError(why, before_response=not self._head_done))

    def _message_complete(self) -> None:
        response = self._response
        self._end_exchange()
        if response is not None:
            response.finish()

    def _fail(self, exc: UpstreamError) -> None:
        response, head = self._response, self._head
        self._end_exchange()
        self.abort()
        if head is not None and not head.done():
            head.set_exception(exc)
        elif response is not None:
            response.fail(exc)

    def _end_exchange(self) -> None:
        self._parser = None
        self._response = None

    def abort(self) -> None:
        self.closed = True
        self._on_closed(self)
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    """Status, raw headers and the body as it arrives; ``release()`` when done with it."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_loop",
        "_pool",
        "_sink",
        "_waiter",
        "buffered",
        "event_stream",
        "headers",
        "keep_alive",
        "method_head",
        "status",
        "until_close",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: UpstreamPool, method_head: bool) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.until_close = False
        self.method_head = method_head
        #: The answer is ``text/event-stream`` (its silence limit is the stream one).
        self.event_stream = False
        self.buffered = 0
        self._chunks: collections.deque[bytes] = collections.deque()
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop
        self._conn: _Connection | None = None
        self._pool = pool
        self._sink: Callable[[bytes], bool] | None = None

    # fed by the connection
    def feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            if not sink(data):
                self._sink = None  # the receiver is slow: pipe() pauses reading and returns
                self._wake()
            return
        self._chunks.append(data)
        self.buffered += len(data)
        self._wake()

    def finish(self) -> None:
        self._done = True
        self._wake()

    def fail(self, exc: UpstreamError) -> None:
        if not self._done:
            self._error = exc
            self._conn = None  # already aborted
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # used by the relay
    def body_ready(self) -> bool:
        """Whether ``read_chunk`` would return at once (data or the end already received)."""
        return bool(self._chunks) or self._done or self._error is not None

    def at_eof(self) -> bool:
        """Whether the whole body has been received and read."""
        return self._done and not self._chunks

    async def read_chunk(self) -> bytes:
        """Everything received since the last call (waiting for something); b"" at the end."""
        while not self._chunks:
            if self._done:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        was_paused = self.buffered > _HIGH_WATER
        self.buffered = 0
        if was_paused and self._conn is not None:
            self._conn.resume_reading()
        return data

    async def pipe(self, sink: Callable[[bytes], bool]) -> bool:
        """Hand the body to ``sink`` chunk by chunk, as it arrives, from the connection's own callback.

        No task wakes per chunk, which is what a stream of small events costs most. Returns
        True at the end of the body; False as soon as ``sink`` returns False (its receiver
        is slow): reading from the engine is then paused until the next ``pipe``.
        Raises :class:`UpstreamError` as ``read_chunk`` does.
        """
        chunks = self._chunks
        while chunks:
            if not sink(chunks.popleft()):
                return self._stop_pipe()
        self.buffered = 0
        conn = self._conn
        if conn is not None:
            conn.resume_reading()
        self._sink = sink
        try:
            while not self._done and self._error is None and self._sink is sink:
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        finally:
            self._sink = None
        if self._done:
            return not chunks
        if self._error is not None:
            raise self._error
        return self._stop_pipe()

    def _stop_pipe(self) -> bool:
        conn = self._conn
        if conn is not None:
            conn.pause_reading()
        return False

    async def read(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body (for short error bodies)."""
        parts: list[bytes] = []
        size = 0
        while size < limit:
            chunk = await self.read_chunk()
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)[:limit]

    def release(self) -> None:
        """Return the connection to the pool when the exchange ended cleanly, else close it.

        Called on every path; closing a connection mid-response is how the engine learns
        that the client went away (it aborts the request).
        """
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self.keep_alive and not conn.closed:
            self._pool.put(conn)
        else:
            conn.abort()


def parse_origin(base_url: str) -> SplitResult:
    """``base_url`` split, or a ValueError when the relay cannot use it."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream must be an http:// or https:// URL, got {base_url!r}")
    return parts


class UpstreamPool:
    """Keep-alive connections to one ``http://`` or ``https://`` origin."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float | None = 600.0,
        keepalive: float = 4.0,
        stream_read_timeout: float | None = None,
    ) -> None:
        parts = parse_origin(base_url)
        assert parts.hostname is not None
        self.scheme = parts.scheme
        self.host = parts.hostname
        default_port = 443 if parts.scheme == "https" else 80
        self.port = parts.port or default_port
        netloc = self.host if ":" not in self.host else f"[{self.host}]"
        self.host_header = (netloc if self.port == default_port else f"{netloc}:{self.port}").encode("idna")
        #: The upstream's path prefix (``http://engine/prefix`` -> ``/prefix``), prepended to every target.
        self.prefix = parts.path.rstrip("/").encode("latin-1")
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._stream_read_timeout = stream_read_timeout
        self._keepalive = keepalive
        self._ssl: ssl_module.SSLContext | None = (
            ssl_module.create_default_context() if parts.scheme == "https" else None
        )
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def idle_connections(self) -> int:
        return sum(1 for conn in self._idle if not conn.closed)

    async def request(
        self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send one request; returns once the status line and headers have arrived.

        ``target`` is the already validated, percent-encoded path and query; ``headers``
        are sent as given after ``host`` and ``content-length`` (the caller strips
        hop-by-hop fields and any of its own ``host``/``content-length``).
        """
        lines = [method.encode("ascii"), b" ", self.prefix, target, b" HTTP/1.1\r\nhost: ", self.host_header]
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines += (b"\r\ncontent-length: ", str(len(body)).encode())
        for name, value in headers:
            lines += (b"\r\n", name, b": ", value)
        lines.append(b"\r\n\r\n")
        lines.append(body)
        payload = b"".join(lines)
        method_head = method == "HEAD"
        while True:
            conn = await self._acquire()
            response = UpstreamResponse(conn._loop, self, method_head)
            response._conn = conn
            head = conn.start(payload, response)
            try:
                await head
            except UpstreamError as exc:
                response._conn = None
                conn.abort()
                if conn.reused and not conn.received and not isinstance(exc, UpstreamTimeoutError):
                    continue  # the idle-close race: the upstream never saw this request
                raise
            except BaseException:
                response._conn = None
                conn.abort()  # cancelled while waiting: the engine sees the connection drop
                raise
            return response

    def put(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        conn.reused = True
        conn.idle_since = conn._loop.time()
        self._idle.append(conn)

    async def _acquire(self) -> _Connection:
        # The loop comes from the connection where there is one: asyncio.get_running_loop()
        # costs a getpid() syscall on Python 3.11 (its fork check), twice per request before.
        if self._closed:
            raise UpstreamConnectError("upstream client is closed")
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and conn._loop.time() - conn.idle_since < self._keepalive:
                return conn
            conn.abort()
        return await self._connect(asyncio.get_running_loop())

    def _sweep_period(self) -> float | None:
        timeouts = [t for t in (self._read_timeout, self._stream_read_timeout) if t is not None]
        return min(1.0, min(timeouts) / 4) if timeouts else None

    def _sweep(self) -> None:
        self._sweeper = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in list(self._open):
            conn.check_silence(now)
        period = self._sweep_period()
        if self._open and period is not None and not self._closed:
            self._sweeper = loop.call_later(period, self._sweep)

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        conn = _Connection(loop, self._read_timeout, self._open.discard, self._stream_read_timeout)
        try:
            await asyncio.wait_for(
                loop.create_connection(
                    lambda: conn,
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                ),
                self._connect_timeout,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            if isinstance(exc, OSError) and exc.strerror:
                why = exc.strerror
            elif isinstance(exc, OSError):
                why = type(exc).__name__
            else:
                why = f"connect timed out after {self._connect_timeout:g} s"
            raise UpstreamConnectError(f"cannot connect: {why}") from exc
        if not conn.closed:
            self._open.add(conn)
        period = self._sweep_period()
        if self._sweeper is None and period is not None:
            self._sweeper = loop.call_later(period, self._sweep)
        return conn

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
