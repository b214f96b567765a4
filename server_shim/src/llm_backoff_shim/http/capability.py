"""The start-up check of the fast path: are uvicorn's internals there, and do they behave?

:func:`fast_path_problem` answers once per process, before the server starts:

1. the fast path's modules import (uvicorn's httptools protocol among them);
2. every method the fast path overrides or calls exists with the parameters it passes
   (internals.PROTOCOL_METHODS);
3. the fast path's own protocol class, built as ``serve`` builds it, is run on a fake
   transport in a private event loop and fed real requests: a relayed request with a
   body, a pipelined stream (written through the client wire) followed by a request to
   the app, a request refused from its head whose body is then read past, an oversized
   head, and a lost connection. Each answer must be byte for byte what the fast path
   writes, and every task must finish.

Any difference is the problem, in one line; None means the fast path is safe to use.
A release that renames an internal, changes a signature or changes what a callback does
is caught here, at start-up, instead of in answers to clients.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import inspect
import threading
from typing import Any

from llm_backoff_shim.http.coarse_timers import CoarseTimers
from llm_backoff_shim.http.interface import (
    BODY_FOLLOWS,
    CLIENT_WIRE,
    CONNECTION_GONE,
    ConnectionGone,
    wire_answer,
)
from llm_backoff_shim.http.internals import PROTOCOL_METHODS

#: Longest the probe may take (it runs in microseconds; this only bounds a hang).
PROBE_TIMEOUT = 10.0

_REQUIRED_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

_REFUSED = wire_answer(429, [(b"content-length", b"7")], b"refused")


def versions() -> str:
    """The installed versions the fast path depends on, for messages."""
    found = []
    for name in ("uvicorn", "httptools"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


@functools.cache
def fast_path_problem() -> str | None:
    """None when the fast path works with the installed uvicorn; else what is wrong, in one line."""
    try:
        return _check_names() or _run_probe()
    except Exception as exc:  # any surprise at all means: do not use the fast path
        return f"{type(exc).__name__}: {exc}"


def _check_names() -> str | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as exc:
        return f"uvicorn's httptools protocol cannot be imported ({exc})"
    for name, expected in PROTOCOL_METHODS.items():
        method = getattr(HttpToolsProtocol, name, None)
        if not callable(method):
            return f"HttpToolsProtocol.{name} is missing"
        params = list(inspect.signature(method).parameters.values())
        names = tuple(p.name for p in params)
        # The parameters the fast path passes, in order; anything after them must be optional.
        extra = [p for p in params[len(expected) :] if p.default is p.empty and p.kind in _REQUIRED_KINDS]
        if names[: len(expected)] != expected or extra:
            return f"HttpToolsProtocol.{name} takes {names}, not {expected}"
    return None


def _run_probe() -> str | None:
    result: list[str | None] = []

    def run() -> None:
        try:
            result.append(asyncio.run(asyncio.wait_for(_probe(), PROBE_TIMEOUT)))
        except BaseException as exc:
            result.append(f"the probe failed: {type(exc).__name__}: {exc}")

    # A thread of its own: the caller may already run an event loop.
    thread = threading.Thread(target=run, name="fast-path-probe", daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT + 5)
    return result[0] if result else "the probe did not finish"


class _ProbeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return True

    def take(self) -> bytes:
        data = bytes(self.written)
        self.written.clear()
        return data


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The app behind the probe: what uvicorn's own path serves (non-/v1/ requests)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"3")]})
    await send({"type": "http.response.body", "body": b"app"})


class _Relay:
    """Stands in for the proxy: echoes bodies, streams through the client wire, watches for a loss."""

    def __init__(self) -> None:
        self.lost = 0
        self.calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        extensions = scope.get("extensions") or {}
        gone = extensions.get(CONNECTION_GONE)
        if not isinstance(gone, ConnectionGone):
            raise AssertionError("no ConnectionGone in the scope")
        gone.subscribe(self._lost)
        try:
            if scope["path"] == "/v1/stream":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"one", "more_body": True})
                write = extensions[CLIENT_WIRE].chunk_writer()
                if write is None:
                    raise AssertionError("no chunk writer on a started chunked response")
                write(b"two")
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            answer = b"echo:" + body
            headers = [(b"content-length", str(len(answer)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers, BODY_FOLLOWS: True})
            await send({"type": "http.response.body", "body": answer})
        finally:
            gone.unsubscribe(self._lost)

    def _lost(self) -> None:
        self.lost += 1


def _refuse(scope: dict[str, Any]) -> bytes | None:
    return _REFUSED if scope["path"] == "/v1/refuse" else None


async def _wait_for(transport: _ProbeTransport, expected: bytes, what: str) -> str | None:
    for _ in range(2000):
        if len(transport.written) >= len(expected):
            break
        await asyncio.sleep(0.001)
    got = transport.take()
    if got != expected:
        return f"{what}: expected {expected[:200]!r}, got {got[:200]!r}"
    return None


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)


async def _probe() -> str | None:
    import uvicorn
    from uvicorn.server import ServerState

    from llm_backoff_shim.http.fast_path import fast_protocol
    from llm_backoff_shim.http.limits import Limits

    events: list[str] = []
    relay = _Relay()
    limits = Limits(PROBE_TIMEOUT, max_head_bytes=1024, body_timeout=PROBE_TIMEOUT, on_event=events.append)
    protocol_class = fast_protocol(relay, limits, refuse=_refuse, body_timers=CoarseTimers(PROBE_TIMEOUT))
    config = uvicorn.Config(
        _app,
        http=protocol_class,
        lifespan="off",
        log_config=None,
        proxy_headers=False,
        server_header=False,
        date_header=False,
    )
    config.load()
    state = ServerState()

    transport = _ProbeTransport()
    protocol = protocol_class(config=config, server_state=state, app_state={})
    protocol.connection_made(transport)
    host = b"host: probe\r\n"
    steps: list[tuple[bytes, bytes, str]] = [
        (
            b"POST /v1/echo HTTP/1.1\r\n" + host + b"content-length: 2\r\n\r\nhi",
            _answer(b"echo:hi"),
            "a relayed request",
        ),
        (
            b"GET /v1/stream HTTP/1.1\r\n" + host + b"\r\nGET /other HTTP/1.1\r\n" + host + b"\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n"
            + _answer(b"app"),
            "a pipelined stream, then a request to the app",
        ),
        (
            b"POST /v1/refuse HTTP/1.1\r\n" + host + b"content-length: 4\r\n\r\nab",
            _REFUSED,
            "a request refused from its head",
        ),
        (
            b"cd" + b"POST /v1/echo HTTP/1.1\r\n" + host + b"content-length: 1\r\n\r\nx",
            _answer(b"echo:x"),
            "the request after a refused one's body",
        ),
    ]
    for data, expected, what in steps:
        protocol.data_received(data)
        problem = await _wait_for(transport, expected, what)
        if problem is not None:
            return problem
    # A connection lost mid-request fires the relay's ConnectionGone.
    protocol.data_received(b"POST /v1/echo HTTP/1.1\r\n" + host + b"content-length: 5\r\n\r\nab")
    for _ in range(100):
        await asyncio.sleep(0)
    protocol.connection_lost(None)
    for _ in range(200):
        if not state.tasks:
            break
        await asyncio.sleep(0.001)
    if relay.lost != 1 or state.tasks:
        return f"a lost connection: ConnectionGone fired {relay.lost} times, {len(state.tasks)} tasks left"
    if relay.calls != 4:  # not for the refused request, nor for the app's
        return f"the relay ran {relay.calls} times, not 4"

    # An oversized head on a new connection: the guard's 431, counted, the connection closed.
    transport = _ProbeTransport()
    protocol = protocol_class(config=config, server_state=state, app_state={})
    protocol.connection_made(transport)
    protocol.data_received(b"GET /v1/x HTTP/1.1\r\n" + b"x-pad: " + b"a" * 2000)
    got = transport.take()
    protocol.connection_lost(None)
    if not got.startswith(b"HTTP/1.1 431 ") or not transport.closed or events != ["headers_too_large"]:
        return f"an oversized head: got {got[:80]!r}, closed={transport.closed}, events={events}"
    return None
