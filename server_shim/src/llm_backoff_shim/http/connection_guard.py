"""Connection-level limits uvicorn does not have: a request-head read timeout and a head size cap.

uvicorn bounds the idle time *between* requests (``timeout_keep_alive``) but not the
time a client may take to send a request's head, and with httptools it does not bound
the head's size at all. A slow-loris client (one header byte every few seconds) or a
megabyte of headers would then hold a socket and memory for as long as it likes.

:func:`guarded_protocol` returns a subclass of uvicorn's HTTP protocol class (the
documented ``http=`` extension point of ``uvicorn.Config``) that:

- starts a timeout when a request head begins (connection opened, or first bytes of the
  next request on a kept-alive connection, when they do not hold the whole head; kept on a shared
  :class:`~llm_backoff_shim.http.coarse_timers.CoarseTimers`, so it may fire up to a quarter
  of ``head_timeout`` late) and, if the head is not complete when it fires, answers
  ``408`` in OpenAI error format and closes the connection; a new connection that has
  sent nothing at all by then is closed quietly and not counted (a client's idle
  pooled connection looks exactly like that);
- counts the bytes of the head and answers ``431`` when they exceed ``max_head_bytes``;
- answers uvicorn's own "Invalid HTTP request" (malformed request line, bad header
  syntax, ...) with an OpenAI-format ``400`` instead of a plain-text one, and refuses so
  what httptools lets through but nginx does not (:func:`head_problem`): a request line
  without an HTTP/1.x version (``GET /x\\nX-Injected: 1 HTTP/1.1`` parses as HTTP/0.9 with
  headers), a duplicate ``Host``, or none on HTTP/1.1.

Under httptools the guard follows the parser's message boundaries (``on_message_begin``,
``on_message_complete``), so the bytes after a request's body are timed and counted as the
next head whatever state the answer is in: a head pipelined behind an answer still in
progress is capped and timed too (nginx and HAProxy stop reading at a few MiB), and the rest
of a body the answer did not wait for is never mistaken for a head (no stray ``408``). A
head that starts inside a read counts from the next read, so the cap may be passed by at most
one read (256 KiB) before the guard answers. While an answer is in progress the ``431`` or
``408`` waits for it to end (nothing is written into the middle of a response), reading stops
meanwhile and anything more the client sends is dropped.

Each event is reported through ``on_event(reason)`` so it is counted
(``llm_backoff_shim_bad_requests_total{reason}``). The body of a request is the ASGI
app's business (the proxy has its own body timeout and size limit).

Head completion is detected the same way for both uvicorn implementations (h11 and
httptools, and the relay's direct path in :mod:`llm_backoff_shim.http.relay_protocol`): each
makes a new cycle ``self.cycle`` when a head has been parsed.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

from llm_backoff_shim.http.coarse_timers import CoarseTimers
from llm_backoff_shim.http.errors import closing_error

OnEvent = Callable[[str], None]

HEAD_TIMEOUT = "header_timeout"
HEAD_TOO_LARGE = "headers_too_large"
MALFORMED_HTTP = "malformed_http"

# The blank line ending a request head (bare LF tolerated, as lenient parsers do).
_HEAD_END = re.compile(rb"\r?\n\r?\n")


class BadHead(Exception):  # noqa: N818 - raised inside a parser callback, which turns it into a 400
    """A request head httptools accepted but the shim refuses (see :func:`head_problem`)."""


def head_problem(http_version: str, headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a parsed head must be refused (``headers`` with lowercase names, as uvicorn keeps them).

    HTTP/0.9 is what httptools makes of a request line with a line break inside it; a second
    ``Host`` (or none, on HTTP/1.1: RFC 9112 section 3.2) leaves the target ambiguous.
    """
    if http_version != "1.1" and http_version != "1.0":
        return "no HTTP/1.x version in the request line"
    hosts = 0
    for name, _ in headers:
        if name == b"host":
            hosts += 1
    if hosts > 1 or (hosts == 0 and http_version == "1.1"):
        return "exactly one Host header is required"
    return None


def default_protocol_class() -> type[Any]:
    """uvicorn's httptools protocol when httptools is installed (its ``auto`` choice), else h11."""
    # Imported here: the public path uses this module's answers and must not depend on
    # uvicorn's protocol modules being where they are.
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools comes with uvicorn[standard]
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    return HttpToolsProtocol


def guarded_protocol(
    base: type[Any] | None = None,
    *,
    head_timeout: float,
    max_head_bytes: int,
    on_event: OnEvent = lambda _reason: None,
) -> type[Any]:
    """A subclass of ``base`` (an uvicorn HTTP protocol class) enforcing the limits above."""
    if not head_timeout > 0:
        raise ValueError("head_timeout must be > 0")
    if max_head_bytes < 1:
        raise ValueError("max_head_bytes must be >= 1")
    parent = base if base is not None else default_protocol_class()
    timers = CoarseTimers(head_timeout)
    _too_large = closing_error(431, f"request head larger than {max_head_bytes} bytes", HEAD_TOO_LARGE)
    _timed_out = closing_error(408, f"request head not received within {head_timeout:g} s", HEAD_TIMEOUT)
    _malformed = closing_error(400, "invalid HTTP request", MALFORMED_HTTP)

    # httptools reports message boundaries; h11 buffers and bounds a pipelined head itself.
    parser_events = hasattr(parent, "on_message_complete")

    class GuardedProtocol(parent):  # type: ignore[misc,valid-type]
        _guard_timer: int | None = None
        _guard_reading = False  # a request head is being read: its bytes are counted
        _guard_bytes = 0
        _guard_cycle: object = None
        _guard_closed = False
        _guard_tail = b""
        _guard_between = True  # no request message open: the next byte begins a head (httptools)
        _guard_began = False  # a message began during the current read
        _guard_pending: tuple[str, bytes] | None = None  # a refusal waiting for the answer to end

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._guard_begin()
            self._guard_arm()  # a connection that never sends is timed too

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_closed = True
            self._guard_stop()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._guard_closed:
                return
            if self._guard_pending is not None:
                self.flow.pause_reading()  # the connection ends with the answer in progress
                return
            if not self._guard_reading and self._guard_next_is_head():
                self._guard_begin()
            if self._guard_reading:
                # Judge the head's size before the parser sees it, so an oversized head never
                # becomes a request (parsers hand the whole head over at once).
                seen = self._guard_tail + data
                end = _HEAD_END.search(seen)
                head_part = len(data) if end is None else max(0, end.end() - len(self._guard_tail))
                self._guard_bytes += head_part
                self._guard_tail = seen[-3:]
                if self._guard_bytes > max_head_bytes:
                    self._guard_reject(HEAD_TOO_LARGE, _too_large)
                    return
            self._guard_began = False
            super().data_received(data)
            if self._guard_ended():
                return
            if self._guard_reading:
                if self.cycle is not self._guard_cycle:
                    self._guard_reading = False
                    self._guard_stop()  # a head was parsed; its body is the app's concern
                elif self._guard_timer is None:
                    # The head is split over reads: time the rest. Most heads arrive whole
                    # and never need a timer (two dict operations per request saved).
                    self._guard_arm()
            elif self._guard_began and self.cycle is self._guard_cycle:
                # A head began inside this read (pipelined after a body) and is not complete:
                # counted from the next read on, and timed from now.
                self._guard_reading = True
                self._guard_tail = data[-3:]
                self._guard_arm()

        def on_message_begin(self) -> None:
            self._guard_between = False
            self._guard_began = True
            if self.cycle is not self._guard_cycle:
                # Another head since the guard last began one: this read holds its start.
                self._guard_stop()
                self._guard_cycle = self.cycle
                self._guard_bytes = 1
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._guard_between = True
            super().on_message_complete()

        def on_response_complete(self) -> None:
            pending = self._guard_pending
            if pending is not None and self.cycle.response_complete:
                self._guard_pending = None
                self._guard_write(*pending)
                return
            super().on_response_complete()

        if parser_events:

            def on_headers_complete(self) -> None:
                problem = head_problem(self.parser.get_http_version(), self.headers)
                if problem is not None:
                    raise BadHead(problem)  # the parser stops; uvicorn answers 400 (below)
                super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if self._guard_closed:
                return
            self._guard_reject(MALFORMED_HTTP, _malformed)

        # -- internals ---------------------------------------------------------------
        def _guard_ended(self) -> bool:
            return self._guard_closed  # a method: the parser's callbacks may have set it

        def _guard_next_is_head(self) -> bool:
            if parser_events:
                return self._guard_between
            cycle = self.cycle
            return cycle is None or cycle.response_complete

        def _guard_begin(self) -> None:
            self._guard_reading = True
            self._guard_bytes = 0
            self._guard_tail = b""
            self._guard_cycle = self.cycle

        def _guard_arm(self) -> None:
            self._guard_timer = timers.add(self._guard_expired, self.loop)

        def _guard_stop(self) -> None:
            if self._guard_timer is not None:
                timers.discard(self._guard_timer)
                self._guard_timer = None

        def _guard_expired(self) -> None:
            self._guard_timer = None
            if self._guard_closed or not self._guard_reading or self.cycle is not self._guard_cycle:
                return
            if self._guard_bytes == 0:
                # Never a byte: an idle connection (a client pool's spare), not a bad request.
                # Closed quietly, as uvicorn closes idle kept-alive ones; a stray 408 would be
                # read as the answer to the next request the client sends on it.
                self._guard_closed = True
                self.transport.close()
                return
            self._guard_reject(HEAD_TIMEOUT, _timed_out)

        def _guard_reject(self, reason: str, payload: bytes) -> None:
            in_head = self._guard_reading or (self._guard_began and self.cycle is self._guard_cycle)
            self._guard_stop()
            self._guard_reading = False
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and (in_head or reason != MALFORMED_HTTP):
                # The refusal is of a head pipelined behind an answer still in progress: it follows
                # that answer, and the connection reads nothing more meanwhile.
                if self._guard_pending is None:
                    self._guard_pending = (reason, payload)
                self.flow.pause_reading()
                return
            self._guard_write(reason, payload)

        def _guard_write(self, reason: str, payload: bytes) -> None:
            self._guard_closed = True
            on_event(reason)
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(payload)
                transport.close()

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{parent.__name__}"
    return GuardedProtocol
