"""The serving protocol's direct path: a ``/v1/`` request goes from the parser to the relay.

uvicorn turns every request into an ASGI call through the same machinery: its general
request cycle, its middleware (proxy headers), the app's router. For the relay's
requests that machinery was about half of the shim's CPU per request on the benchmark
machines. :func:`relay_protocol`
subclasses the serving protocol class (uvicorn's httptools protocol with the
connection guard): when a request head under ``/v1/`` is parsed, it builds a
:class:`~llm_backoff_shim.http.relay_cycle.RelayCycle` and runs the relay on it directly.
Everything else (``/health``, ``/metrics``, odd paths, upgrades) takes uvicorn's own
path to the Starlette app, unchanged. Keep-alive, pipelining, flow control, the guard's
limits and graceful shutdown stay uvicorn's: the cycle has the attributes they use.

Only the httptools protocol has this path; under h11 (httptools missing) every request
takes uvicorn's path, and the relay falls back to what it does under any ASGI server.

A generation request that admission can only refuse (every slot taken, no place in its
queue) is answered from its head when the relay says so (``refuse``, the proxy's
:meth:`~llm_backoff_shim.serve.request_path.proxy.Proxy.refuse_from_head`): no task, no body buffered. The
connection stays open; the request's body is read past (:class:`ReadingPast`) and the
connection serves its next request as usual. Only on a kept-alive connection that did
not ask for ``100-continue`` and has no response in progress: closing a connection the
client is still writing to can reset it before the client reads the answer, and a
``100-continue`` client waits to be told to send its body.

The protocol also hands the relay two per-connection objects through
``scope["extensions"]``:

- :class:`ConnectionGone` (``CONNECTION_GONE``) fires when the client's connection is
  lost, so the relay needs no task of its own per request blocked on ``receive()`` just
  to notice a disconnect (about 20 us of CPU per request here);
- :class:`ClientWire` (``CLIENT_WIRE``): once a chunked response has started, the relay
  writes a stream's chunks straight onto the client's transport from the engine
  connection's callback, instead of waking the request's task and going through
  ``send`` for every token (about a quarter of the CPU per relayed event here).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Callable
from typing import Any

import httptools

from llm_backoff_shim.http.coarse_timers import CoarseTimers
from llm_backoff_shim.http.connection_guard import BadHead, head_problem
from llm_backoff_shim.http.interface import (
    CLIENT_WIRE,
    CONNECTION_GONE,
    ChunkWriter,
    ConnectionGone,
    HeadRefusal,
)
from llm_backoff_shim.http.relay_cycle import RelayCycle

__all__ = ["CLIENT_WIRE", "CONNECTION_GONE", "ClientWire", "ConnectionGone", "ReadingPast", "relay_protocol"]


class _NoEvent:
    """The ``message_event`` of a cycle nobody waits on (uvicorn sets it on a disconnect)."""

    __slots__ = ()

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()


class ReadingPast:
    """The cycle of a request answered from its head, while its body is still arriving.

    The attributes are the ones uvicorn's protocol uses on a cycle. The response is
    written but not complete until the request's last byte is read, so the connection's
    next bytes are still this body (the head guard does not time them as a new head), and
    the next request begins only then. A client that stops sending mid-body is cut off
    after the body timeout, as one on the usual path would be.
    """

    __slots__ = ("disconnected", "keep_alive", "response_complete", "timer")

    message_event = _NO_EVENT

    def __init__(self) -> None:
        self.disconnected = False
        self.keep_alive = True  # uvicorn clears it on shutdown: then closed once the body is in
        self.response_complete = False
        self.timer: int | None = None


class ClientWire:
    """Direct access to the client's socket for the body of a chunked response.

    The cycle's ``send`` stays in charge of the response's head and end, and of waiting
    for a slow client (flow control); only the chunks in between bypass it. Writing
    them here is only valid while the connection's current cycle has a started,
    unfinished, chunked response, which :meth:`chunk_writer` checks once per response;
    otherwise it returns None and the relay uses ``send``. One wire per connection
    follows the newest request: with pipelining, its response cannot start before the
    one in progress ends.
    """

    __slots__ = ("_flow", "_transport", "cycle")

    def __init__(self, transport: asyncio.Transport, flow: Any) -> None:
        self.cycle: RelayCycle | None = None
        self._transport = transport
        self._flow = flow

    def chunk_writer(self) -> ChunkWriter | None:
        cycle = self.cycle
        if (
            cycle is None
            or cycle.chunked_encoding is not True
            or not cycle.response_started
            or cycle.response_complete
            or cycle.disconnected
        ):
            return None
        cycle.flush_head()
        write = self._transport.write
        closing = self._transport.is_closing
        flow = self._flow

        def write_chunk(data: bytes) -> bool:
            # The frame the cycle would write for {"body": data, "more_body": True}.
            write(b"%x\r\n%b\r\n" % (len(data), data))
            return not flow.write_paused and not closing()

        return write_chunk


def relay_protocol(
    base: type[Any],
    relay: Callable[..., Any],
    *,
    refuse: HeadRefusal | None = None,
    body_timers: CoarseTimers | None = None,
) -> type[Any]:
    """A subclass of ``base`` (uvicorn's httptools protocol or a subclass) serving ``/v1/`` with
    ``relay``; ``refuse`` answers a request from its head when it can, ``body_timers`` time the
    rest of such a request's body (None: untimed)."""

    class RelayProtocol(base):  # type: ignore[misc]
        _relay_gone: ConnectionGone
        _relay_wire: ClientWire
        cycle: Any  # uvicorn's per-request cycle: its own class, or a RelayCycle

        def connection_made(self, transport: asyncio.Transport) -> None:
            self._relay_gone = ConnectionGone()
            super().connection_made(transport)
            self._relay_wire = ClientWire(transport, self.flow)

        def connection_lost(self, exc: Exception | None) -> None:
            past = self.cycle
            if body_timers is not None and past.__class__ is ReadingPast:
                body_timers.discard(past.timer)
            super().connection_lost(exc)
            self._relay_gone.fire()

        def on_headers_complete(self) -> None:
            url: bytes = self.url
            parser = self.parser
            if (
                not url.startswith(b"/v1/")
                or self.root_path
                or self.limit_concurrency is not None
                or parser.should_upgrade()
            ):
                super().on_headers_complete()
                return
            parsed_url = httptools.parse_url(url)
            raw_path: bytes = parsed_url.path
            path = raw_path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
                if "\n" in path:
                    super().on_headers_complete()  # no route matches it: the app's 404
                    return
            http_version: str = parser.get_http_version()
            problem = head_problem(http_version, self.headers)
            if problem is not None:
                raise BadHead(problem)  # the parser stops; the protocol answers 400
            scope = self.scope
            scope["method"] = parser.get_method().decode("ascii")
            if http_version != "1.1":
                scope["http_version"] = http_version
            scope["path"] = path
            scope["raw_path"] = raw_path
            scope["query_string"] = parsed_url.query or b""
            scope["extensions"] = {CONNECTION_GONE: self._relay_gone, CLIENT_WIRE: self._relay_wire}
            existing = self.cycle
            keep_alive = http_version != "1.0" and parser.should_keep_alive()
            if (
                refuse is not None
                and keep_alive
                and not self.expect_100_continue
                and (existing is None or existing.response_complete)
            ):
                try:
                    answer = refuse(scope)
                except Exception:
                    # A parser callback has no app to turn a failure into a 500: the request
                    # takes the usual path instead, where one would.
                    self.logger.exception("refusing a request from its head failed")
                    answer = None
                if answer is not None:
                    self.transport.write(answer)
                    self.cycle = past = ReadingPast()
                    self._relay_wire.cycle = None
                    if body_timers is not None:
                        past.timer = body_timers.add(self._relay_body_expired, self.loop)
                    return
            cycle = RelayCycle(
                scope,
                self.transport,
                self.flow,
                self.logger,
                expect_100_continue=self.expect_100_continue,
                keep_alive=keep_alive,
                on_response=self.on_response_complete,
                read_past=self._read_past_then_close,
            )
            self.cycle = cycle
            self._relay_wire.cycle = cycle
            if existing is None or existing.response_complete:
                # As uvicorn starts a request's task: in the server's task set, which its
                # shutdown waits on.
                task = self.loop.create_task(cycle.run_asgi(relay))
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)
            else:
                # Pipelined: it starts when the response in progress ends (uvicorn's queue).
                self.flow.pause_reading()
                self.pipeline.appendleft((cycle, relay))

        def on_body(self, body: bytes) -> None:
            if self.cycle.__class__ is not ReadingPast:
                super().on_body(body)

        def on_message_complete(self) -> None:
            past = self.cycle
            if past.__class__ is not ReadingPast:
                super().on_message_complete()
                return
            if body_timers is not None:
                body_timers.discard(past.timer)
            past.response_complete = True
            super().on_message_complete()  # the message's end for the head guard (answered: no more)
            if past.keep_alive:
                self.on_response_complete()  # the next request may begin
            else:
                self.transport.close()

        def _read_past_then_close(self) -> None:
            """The answer is out but its request's body is not all in: read the rest past
            (:class:`ReadingPast`, not kept alive), then close; a client that stops sending is
            cut off after the body timeout."""
            self.cycle = past = ReadingPast()
            past.keep_alive = False
            self._relay_wire.cycle = None
            self.flow.resume_reading()
            if body_timers is not None:
                past.timer = body_timers.add(self._relay_body_expired, self.loop)

        def _relay_body_expired(self) -> None:
            past = self.cycle
            if past.__class__ is ReadingPast and not past.response_complete:
                past.response_complete = True
                self.transport.close()

    RelayProtocol.__name__ = RelayProtocol.__qualname__ = f"Relay{base.__name__}"
    return RelayProtocol
