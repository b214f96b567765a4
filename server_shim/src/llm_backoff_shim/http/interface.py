"""What the proxy needs from the HTTP layer: from a client's connection and from the upstream.

The proxy is an ASGI app and reads the same whichever serving path runs it
(:mod:`llm_backoff_shim.http.paths`). Beyond ASGI it uses only what this module names,
and each piece is optional, so the proxy works without it under any ASGI server:

- ``scope["extensions"][CONNECTION_GONE]``: a :class:`ConnectionGone` that fires when the
  client's connection is lost, so the relay needs no watcher task per request blocked
  on ``receive()`` just to notice a disconnect. Both serving paths provide it.
- ``scope["extensions"][CLIENT_WIRE]``: a :class:`ClientWire`, through which a chunked
  response's body may be written straight onto the client's socket. Only the fast path
  provides it.
- ``BODY_FOLLOWS`` in an ``http.response.start`` message: a body message follows at
  once, so the head may be written together with it. Servers that do not know the key
  ignore it, as ASGI lets them.
- :func:`wire_answer`: a whole answer as bytes, for a serving path that writes a
  refusal from a request's head (:data:`HeadRefusal`).
- From the upstream: :class:`UpstreamResponse` and the one error, :class:`UpstreamError`.

Nothing here imports a server's internals: importing the proxy never depends on a
server version (the fast path's internals are checked at start-up, capability.py).
"""

from __future__ import annotations

import http
from collections.abc import Callable
from typing import Any, Protocol

from llm_backoff_shim.http.upstream_http import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeoutError,
)

__all__ = [
    "BODY_FOLLOWS",
    "CLIENT_WIRE",
    "CONNECTION_GONE",
    "STATUS_LINE",
    "ChunkWriter",
    "ClientWire",
    "ConnectionGone",
    "HeadRefusal",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTimeoutError",
    "wire_answer",
]

#: The ``scope["extensions"]`` key of the connection's :class:`ConnectionGone`.
CONNECTION_GONE = "llm_backoff.connection_gone"
#: The ``scope["extensions"]`` key of the connection's :class:`ClientWire`.
CLIENT_WIRE = "llm_backoff.client_wire"
#: Key of an ``http.response.start`` message: a body message follows at once.
BODY_FOLLOWS = "llm_backoff.body_follows"

#: Called with each body chunk; False means stop for now (the client is slow or gone).
ChunkWriter = Callable[[bytes], bool]

#: A serving path's question to the relay about a request's head: the whole answer to write
#: at once (:func:`wire_answer`), or None to serve the request as usual.
HeadRefusal = Callable[[dict[str, Any]], bytes | None]


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return b"HTTP/1.1 %d %b\r\n" % (status, phrase.encode("ascii"))


#: ``HTTP/1.1 <status> <reason>\r\n`` for every status an answer can carry.
STATUS_LINE: dict[int, bytes] = {status: _status_line(status) for status in range(100, 600)}


def wire_answer(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A whole response the shim made itself (its headers carry content-length), as written."""
    return b"".join([STATUS_LINE[status], *(b"%b: %b\r\n" % header for header in headers), b"\r\n", body])


class ConnectionGone:
    """Fires its subscribers once, when the client's connection is lost."""

    __slots__ = ("_callbacks", "lost")

    def __init__(self) -> None:
        self.lost = False
        self._callbacks: set[Callable[[], None]] = set()

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the connection is lost (at once if it already is)."""
        if self.lost:
            callback()
        else:
            self._callbacks.add(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        self._callbacks.discard(callback)

    def fire(self) -> None:
        self.lost = True
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()


class ClientWire(Protocol):
    """Direct access to the client's socket for the body of a chunked response."""

    def chunk_writer(self) -> ChunkWriter | None:
        """A writer for the current response's next chunks, or None: then use ``send``."""
