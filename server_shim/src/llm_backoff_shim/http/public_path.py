"""The public serving path: uvicorn's h11 protocol, its public API only, with the shim's guards.

(Just over 400 lines: one protocol wrapper whose head guard, body framing and transport hand-off
read as one sequence.)

The fast path (relay_protocol.py) extends uvicorn's httptools protocol from inside; this
path serves the same app through interfaces that do not move between releases, for
when the start-up check (capability.py) finds the fast path's internals missing or
changed. The proxy behaves the same on both: this path gives it the same head limits,
body limits, refusal before the body and disconnect signal.

How, and why this way:

- uvicorn's h11 parser (``http="h11"``), not httptools: measured against nginx on
  hostile input, uvicorn's httptools protocol forwards a bare LF in the request line
  and a duplicate or missing ``Host``; h11 refuses them as nginx does. Its
  ``h11_max_incomplete_event_size`` (a documented setting) caps what it buffers.
- uvicorn has no request-head timeout at all (50 slow-loris connections stayed open
  45 s), so :func:`public_protocol` wraps the h11 protocol in a plain
  :class:`asyncio.Protocol`, passed as uvicorn's ``http=`` protocol class (the type
  ``uvicorn.Config`` declares). It forwards every call to the protocol uvicorn would
  have made, with the arguments uvicorn gave, and reads nothing inside it: it counts
  the bytes of each request head it sees, answers ``431`` past ``max_head_bytes``,
  ``408`` when a head is not complete within ``head_timeout`` (a new connection that
  sent nothing is closed quietly), and turns uvicorn's plain-text ``400`` for an
  unparsable head into the shim's OpenAI-format one. To know where each head starts it
  follows the request framing itself (heads end with a blank line, bodies are
  ``Content-Length`` bytes or chunks); a request it cannot frame plainly (unclear
  lengths, other transfer codings) is left to h11 and its connection is closed after
  the answer.
- The ASGI side (public_app.py) tells the connection when a request's answer is
  complete, so a pipelined head is timed only while no answer is in progress (h11
  stops reading meanwhile), and the body of a request answered before its body was
  read is read past on the body timer, never parsed as the next head.

Connections are matched to requests by the peer address (``scope["client"]``; uvicorn
runs with ``proxy_headers`` off, so it is the socket's peer).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

from llm_backoff_shim.http.coarse_timers import CoarseTimers
from llm_backoff_shim.http.connection_guard import HEAD_TIMEOUT, HEAD_TOO_LARGE, MALFORMED_HTTP, OnEvent
from llm_backoff_shim.http.errors import closing_error
from llm_backoff_shim.http.interface import ConnectionGone

Peer = tuple[str, int]

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_FRAMING = re.compile(rb"\n(content-length|transfer-encoding)[ \t]*:[ \t]*([^\r\n]*)", re.IGNORECASE)
# The start of uvicorn's own answer to a request h11 could not parse.
_PLAIN_400 = b"HTTP/1.1 400 "

# Where the connection's next byte falls: a head, a body (or a chunk's data), a chunk-size
# line, a chunked body's trailer section, or somewhere only h11 knows.
_HEAD, _BODY, UNFRAMED, _CHUNK_SIZE, _TRAILER = 0, 1, 2, 3, 4
#: The states inside a request body.
BODY_STATES = (_BODY, _CHUNK_SIZE, _TRAILER)
#: A chunk-size line or trailer line longer than this is left to h11 (which refuses it).
_LINE_LIMIT = 4096
#: What :func:`_body_length` returns for a chunked body.
_CHUNKED = -1


def _nothing() -> None:
    pass


def _peer(transport: asyncio.BaseTransport) -> Peer | None:
    """The peer address as uvicorn puts it in ``scope["client"]``."""
    sock = transport.get_extra_info("socket")
    try:
        info = sock.getpeername() if sock is not None else transport.get_extra_info("peername")
    except OSError:
        return None
    if isinstance(info, (tuple, list)) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return None


def _body_length(head: bytes) -> int | None:
    """The body length a request head declares (0 without one, ``_CHUNKED`` for a chunked body),
    None when it is neither a plain length nor plainly chunked (h11 then decides)."""
    lengths = set()
    encodings = []
    for name, value in _FRAMING.findall(head):
        if name.lower() == b"transfer-encoding":
            encodings.append(value.strip().lower())
        else:
            lengths.add(value.strip())
    if encodings:
        return _CHUNKED if encodings == [b"chunked"] and not lengths else None
    if not lengths:
        return 0
    if len(lengths) > 1:
        return None
    (value,) = lengths
    return int(value) if value.isdigit() else None


class Connection:
    """One client connection as the protocol wrapper and the ASGI side (public_app.py) both see it."""

    __slots__ = (
        "body_left",
        "chunked",
        "closed",
        "gone",
        "head",
        "in_progress",
        "lingering",
        "on_answered",
        "refusal",
        "replacing",
        "state",
        "timer",
        "timer_set",
        "transport",
    )

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.gone = ConnectionGone()
        self.state = _HEAD
        self.head = bytearray()  # the bytes of the head being read (at most max_head_bytes)
        self.body_left = 0
        self.chunked = False  # the body being read is chunked
        self.in_progress = 0  # requests handed to the app and not yet answered
        self.timer: int | None = None
        self.timer_set: CoarseTimers | None = None
        self.closed = False
        self.lingering = False  # closed by h11 mid-body: its rest is read past before the close
        self.replacing = False  # uvicorn's plain 400 is being replaced by ours
        self.refusal: str | None = None  # a pipelined head's refusal, written after the answers in progress
        self.on_answered: Callable[[], None] = _nothing

    def answered(self) -> None:
        """The app finished an answer on this connection (called by the ASGI side)."""
        self.in_progress -= 1
        self.on_answered()

    def stop_timer(self) -> None:
        if self.timer is not None and self.timer_set is not None:
            self.timer_set.discard(self.timer)
        self.timer = self.timer_set = None


class _Transport(asyncio.Transport):
    """The transport the h11 protocol writes to: the real one, except for uvicorn's plain 400."""

    def __init__(
        self, real: asyncio.Transport, conn: Connection, on_event: OnEvent, on_close: Callable[[], None]
    ) -> None:
        super().__init__()
        self._real = real
        self._conn = conn
        self._on_event = on_event
        self._on_close = on_close

    def write(self, data: bytes | bytearray | memoryview) -> None:
        conn = self._conn
        if conn.lingering or conn.replacing:
            return  # closed (lingering), or the rest of uvicorn's 400 (its body, its end)
        if conn.in_progress == 0 and bytes(data[: len(_PLAIN_400)]) == _PLAIN_400:
            # No request is with the app: this is uvicorn's answer to a head h11 refused.
            conn.replacing = True
            self._on_event(MALFORMED_HTTP)
            data = closing_error(400, "invalid HTTP request", MALFORMED_HTTP)
        self._real.write(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def close(self) -> None:
        self._on_close()

    def is_closing(self) -> bool:
        return self._conn.lingering or self._real.is_closing()

    def abort(self) -> None:
        self._real.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._real.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._real.pause_reading()

    def resume_reading(self) -> None:
        self._real.resume_reading()

    def is_reading(self) -> bool:
        return self._real.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._real.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._real.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._real.get_write_buffer_limits()

    def write_eof(self) -> None:
        self._real.write_eof()

    def can_write_eof(self) -> bool:
        return self._real.can_write_eof()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._real.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._real.get_protocol()


def public_protocol(
    inner: Callable[..., asyncio.Protocol],
    connections: dict[Peer, Connection],
    *,
    head_timeout: float,
    max_head_bytes: int,
    body_timeout: float,
    on_event: OnEvent = lambda _reason: None,
) -> type[asyncio.Protocol]:
    """An :class:`asyncio.Protocol` class for uvicorn's ``http=``: ``inner`` (uvicorn's h11 protocol
    class) behind the head limits above; ``connections`` is shared with the ASGI side."""
    if not head_timeout > 0 or not body_timeout > 0:
        raise ValueError("head_timeout and body_timeout must be > 0")
    head_timers = CoarseTimers(head_timeout)
    body_timers = CoarseTimers(body_timeout)

    class PublicProtocol(asyncio.Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._inner = inner(*args, **kwargs)
            self._conn: Connection | None = None
            self._peer: Peer | None = None

        def connection_made(self, transport: Any) -> None:
            # Any: uvloop's transports are not asyncio.Transport subclasses.
            conn = self._conn = Connection(transport)
            self._peer = _peer(transport)
            conn.on_answered = self._answered
            if self._peer is not None:
                connections[self._peer] = conn
            self._inner.connection_made(_Transport(transport, conn, on_event, self._close))
            self._arm(head_timers)  # a connection that never sends is timed too

        def connection_lost(self, exc: Exception | None) -> None:
            conn = self._conn
            if conn is not None:
                conn.closed = True
                conn.stop_timer()
                if self._peer is not None and connections.get(self._peer) is conn:
                    del connections[self._peer]
            self._inner.connection_lost(exc)
            if conn is not None:
                conn.gone.fire()

        def data_received(self, data: bytes) -> None:
            conn = self._conn
            if conn is None or conn.closed or conn.refusal is not None or conn.lingering:
                return  # lingering: the rest of a body nobody reads, dropped (_close)
            if conn.state != UNFRAMED and not self._frame(conn, data):
                return
            self._inner.data_received(data)

        def eof_received(self) -> bool | None:
            conn = self._conn
            if conn is not None and conn.lingering:
                return None  # the client sent all it had: the transport closes now
            return self._inner.eof_received()

        def _close(self) -> None:
            """h11's close. Mid-body, the close lingers: the answer is flushed and the sending
            side shut (``write_eof``), and what the client still sends is read and dropped until
            it stops (EOF) or the body timer fires. A socket closed with unread bytes in it is
            reset, and the reset can reach the client before the answer, which is then lost
            (seen on a 413 refused from its declared length); nginx's lingering close does the
            same."""
            conn = self._conn
            if conn is None or conn.lingering or conn.transport.is_closing():
                return
            real = conn.transport
            if conn.state in BODY_STATES and real.can_write_eof():
                conn.lingering = True
                real.write_eof()
                self._arm(body_timers)
                return
            real.close()

        def pause_writing(self) -> None:
            self._inner.pause_writing()

        def resume_writing(self) -> None:
            self._inner.resume_writing()

        # -- framing -----------------------------------------------------------------
        def _frame(self, conn: Connection, data: bytes) -> bool:
            """Follow heads and bodies through ``data``; False when the connection was refused."""
            view = memoryview(data)
            while view:
                if conn.state == _BODY:
                    taken = min(conn.body_left, len(view))
                    conn.body_left -= taken
                    view = view[taken:]
                    if conn.body_left == 0:
                        if conn.chunked:
                            conn.state = _CHUNK_SIZE  # a chunk's data and its CRLF are read
                        else:
                            self._body_read(conn)
                    continue
                if conn.state == UNFRAMED:
                    return True
                if conn.state in (_CHUNK_SIZE, _TRAILER):
                    view = self._chunk_lines(conn, view)
                    continue
                # A head: look for its end in what came before and what came now.
                start = max(0, len(conn.head) - 3)
                conn.head += view
                end = _HEAD_END.search(conn.head, start)
                if end is None:
                    if len(conn.head) > max_head_bytes:
                        return self._refuse_in_turn(conn, HEAD_TOO_LARGE)
                    view = view[len(view) :]
                    if conn.timer is None and conn.in_progress == 0:
                        self._arm(head_timers)
                    continue
                if end.end() > max_head_bytes:
                    return self._refuse_in_turn(conn, HEAD_TOO_LARGE)
                rest = len(conn.head) - end.end()
                length = _body_length(bytes(conn.head[: end.end()]))
                conn.head = bytearray()
                if conn.timer_set is head_timers:
                    conn.stop_timer()
                view = view[len(view) - rest :]
                if length is None:
                    conn.state = UNFRAMED  # h11 frames it; the connection closes after its answer
                elif length == _CHUNKED:
                    conn.state, conn.chunked = _CHUNK_SIZE, True
                elif length:
                    conn.state, conn.body_left = _BODY, length
            return True

        def _chunk_lines(self, conn: Connection, view: memoryview) -> memoryview:
            """Read a chunk-size line or a trailer line off ``view``; the rest of ``view`` after it."""
            start = len(conn.head)
            conn.head += view
            newline = conn.head.find(b"\n", start)
            if newline < 0:
                if len(conn.head) > _LINE_LIMIT:
                    conn.state = UNFRAMED
                return view[len(view) :]
            line = bytes(conn.head[:newline]).rstrip(b"\r")
            rest = len(conn.head) - newline - 1
            conn.head = bytearray()
            if conn.state == _TRAILER:
                if not line:
                    self._body_read(conn)  # the blank line ending the trailers: the body is read
            else:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    conn.state = UNFRAMED  # h11 refuses it
                    return view[len(view) :]
                if size:
                    conn.state, conn.body_left = _BODY, size + 2
                else:
                    conn.state = _TRAILER
            return view[len(view) - rest :] if rest else view[len(view) :]

        def _body_read(self, conn: Connection) -> None:
            conn.state, conn.chunked = _HEAD, False
            if conn.timer_set is body_timers:
                conn.stop_timer()

        def _arm(self, timers: CoarseTimers) -> None:
            conn = self._conn
            assert conn is not None
            conn.stop_timer()
            conn.timer_set = timers
            conn.timer = timers.add(self._expired if timers is head_timers else self._body_expired)

        def _expired(self) -> None:
            conn = self._conn
            assert conn is not None
            conn.timer = conn.timer_set = None
            if conn.closed or conn.state != _HEAD or conn.in_progress:
                return
            if not conn.head:
                if conn.transport.is_closing():
                    return
                # Never a byte of a head: an idle connection (a client pool's spare), not a bad
                # request; closed quietly, as a stray 408 would read as the next request's answer.
                conn.closed = True
                conn.transport.close()
                return
            self._refuse(conn, HEAD_TIMEOUT)

        def _body_expired(self) -> None:
            conn = self._conn
            assert conn is not None
            conn.timer = conn.timer_set = None
            if conn.lingering or (not conn.closed and conn.state in BODY_STATES and not conn.in_progress):
                conn.closed = True
                conn.transport.close()  # the client stopped mid-body after its answer, or lingered out

        def _refuse(self, conn: Connection, reason: str) -> bool:
            conn.stop_timer()
            conn.closed = True
            on_event(reason)
            if reason == HEAD_TOO_LARGE:
                payload = closing_error(
                    431, f"request head larger than {max_head_bytes} bytes", HEAD_TOO_LARGE
                )
            else:
                message = f"request head not received within {head_timeout:g} s"
                payload = closing_error(408, message, HEAD_TIMEOUT)
            if not conn.transport.is_closing():
                conn.transport.write(payload)
                conn.transport.close()
            return False

        def _refuse_in_turn(self, conn: Connection, reason: str) -> bool:
            """Refuse now, or, for a head pipelined behind answers still in progress, once they
            are written (their clients get them first); meanwhile nothing more is read."""
            if conn.in_progress == 0:
                return self._refuse(conn, reason)
            conn.refusal = reason
            conn.stop_timer()
            conn.head = bytearray()
            conn.transport.pause_reading()
            return False

        def _answered(self) -> None:
            conn = self._conn
            assert conn is not None
            if conn.closed or conn.in_progress:
                return
            if conn.refusal is not None:
                # Called just before the answer's last write: the refusal follows it.
                asyncio.get_running_loop().call_soon(self._refuse, conn, conn.refusal)
                return
            if conn.state in BODY_STATES:
                self._arm(body_timers)  # answered before its body: read past it, on a timer
            elif conn.state == _HEAD and conn.head and conn.timer is None:
                self._arm(head_timers)  # a pipelined head, timed from now

    PublicProtocol.__name__ = PublicProtocol.__qualname__ = f"Public{getattr(inner, '__name__', 'Protocol')}"
    return PublicProtocol
