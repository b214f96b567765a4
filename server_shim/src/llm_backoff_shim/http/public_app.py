"""The ASGI side of the public serving path (public_path.py): in front of the shim's app.

For each request it finds the client's connection (by ``scope["client"]``, the socket's
peer: uvicorn runs with ``proxy_headers`` off) and

- gives the relay the connection's :class:`~llm_backoff_shim.http.interface.ConnectionGone`;
- answers a request the relay can only refuse (``refuse``, the proxy's
  ``refuse_from_head``) without reading its body, as the fast path does from the
  parser: only on a kept-alive HTTP/1.1 connection, without ``100-continue``, for a
  body the connection wrapper can frame; the wrapper then reads the body past;
- refuses an HTTP version other than 1.0 and 1.1 (h11 parses any ``HTTP/x.y``) with the
  shim's ``400 malformed_http``, as the fast path's parser and nginx do;
- tells the connection when the answer is complete, so it times the next head from
  then, and closes a connection whose request body it cannot follow after the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from llm_backoff_shim.http.connection_guard import MALFORMED_HTTP, OnEvent
from llm_backoff_shim.http.errors import closing_error
from llm_backoff_shim.http.interface import CONNECTION_GONE, HeadRefusal
from llm_backoff_shim.http.public_path import BODY_STATES, UNFRAMED, Connection, Peer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("llm_backoff_shim.http")


def _split_answer(answer: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """A whole answer made by :func:`~llm_backoff_shim.http.interface.wire_answer`, as ASGI parts."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    headers = [(name, value) for name, _, value in (line.partition(b": ") for line in lines)]
    return int(status_line.split(b" ", 2)[1]), headers, body


class PublicApp:
    """The ASGI side of the public path, in front of the shim's app (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        connections: dict[Peer, Connection],
        *,
        refuse: HeadRefusal | None = None,
        on_event: OnEvent = lambda _reason: None,
    ) -> None:
        self.app = app
        self.connections = connections
        self.refuse = refuse
        self.on_event = on_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client") if scope["type"] == "http" else None
        conn = self.connections.get(client) if client is not None else None
        if conn is None:
            await self.app(scope, receive, send)
            return
        conn.in_progress += 1
        extensions = scope.get("extensions")
        scope["extensions"] = (
            {**extensions, CONNECTION_GONE: conn.gone} if extensions else {CONNECTION_GONE: conn.gone}
        )
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        expects = any(k == b"expect" and v.lower() == b"100-continue" for k, v in headers)
        finished = False

        async def guarded_send(message: Message) -> None:
            nonlocal finished
            kind = message["type"]
            if kind == "http.response.start":
                if conn.state == UNFRAMED or (expects and conn.state in BODY_STATES):
                    # A body h11 frames, or one the client may never send: close after the answer.
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            elif kind == "http.response.body" and not message.get("more_body", False) and not finished:
                # Before the last write: h11 may go on to a pipelined request inside it.
                finished = True
                conn.answered()
            await send(message)

        try:
            if scope.get("http_version") not in ("1.0", "1.1"):
                # h11 parses any HTTP/x.y; the fast path's parser and nginx refuse all but these.
                self.on_event(MALFORMED_HTTP)
                answer: bytes | None = closing_error(400, "invalid HTTP request", MALFORMED_HTTP)
            else:
                answer = self._refusal(scope, expects, conn)
            if answer is not None:
                status, answer_headers, body = _split_answer(answer)
                start = {"type": "http.response.start", "status": status, "headers": answer_headers}
                await guarded_send(start)
                await guarded_send({"type": "http.response.body", "body": body})
                return
            await self.app(scope, receive, guarded_send)
        finally:
            if not finished:
                finished = True
                conn.answered()

    def _refusal(self, scope: Scope, expects: bool, conn: Connection) -> bytes | None:
        refuse = self.refuse
        if refuse is None or expects or conn.state == UNFRAMED or not _keeps_alive(scope):
            return None
        try:
            return refuse(scope)  # type: ignore[arg-type]
        except Exception:
            # The usual path answers instead, where a failure becomes a 500.
            log.exception("refusing a request from its head failed")
            return None


def _keeps_alive(scope: Scope) -> bool:
    if scope.get("http_version") != "1.1":
        return False
    return not any(k == b"connection" and b"close" in v.lower() for k, v in scope["headers"])
