"""The simulator's generation endpoints as raw ASGI apps (hot path, fault injection).

Raw ASGI rather than Starlette responses because the handler needs three things a
``Response`` hides: watching ``receive()`` for ``http.disconnect`` while the request is
queued or generating (non-streamed too), sending pre-encoded SSE bytes without a
generator per request, and resetting the TCP connection for the fault knobs.

Disconnects: a client that goes away at any point (while sending its body, during a
slow-first-byte delay, queued, running) is aborted at once and its slot handed to the
next waiter, as vLLM aborts a request whose HTTP connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
import uuid
from typing import Any

from starlette.types import Receive, Scope, Send

from .engine import AbortReason, PromptTooLongError, QueueFullError, SeqState
from .faults import plan_faults
from .protocol import BadRequestError, Kind, ResponseEncoder, error_body, parse_generation
from .runtime import SimRuntime, Ticket

MAX_BODY_BYTES = 8 * 1024 * 1024
QUEUE_FULL_MESSAGE = "Request queue full."  # vLLM's QueueOverflowError text

_JSON = b"application/json"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    head = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode())]
    if headers:
        head.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _BodyTooLargeError(Exception):
    pass


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client disconnected before sending it."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _BodyTooLargeError
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class _Client:
    """Watches ``receive()`` for ``http.disconnect`` for the rest of the request."""

    def __init__(self, receive: Receive) -> None:
        loop = asyncio.get_running_loop()
        self.gone = False
        self.ticket: Ticket | None = None
        self._gone_future: asyncio.Future[None] = loop.create_future()
        self._task = loop.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                if not self._gone_future.done():
                    self._gone_future.set_result(None)
                if self.ticket is not None:
                    self.ticket.notify()
                return

    async def wait_gone(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the client to go; True if it went."""
        if not self.gone:
            await asyncio.wait({self._gone_future}, timeout=timeout)
        return self.gone

    def close(self) -> None:
        self._task.cancel()


async def _reset_connection(receive: Receive, client: _Client) -> bool:
    """Close the TCP connection with an RST (SO_LINGER 0). False if the server hides its transport.

    uvicorn's ``receive`` is a bound method of its per-request cycle object, which holds
    the transport; no ASGI extension exposes it, so this is the one server-specific bit.
    """
    transport: Any = getattr(getattr(receive, "__self__", None), "transport", None)
    if transport is None or not hasattr(transport, "abort"):
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError, TypeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
    # Return only once the server has seen the connection drop, so it does not try to
    # answer on it or complain about an unfinished response.
    await client.wait_gone(timeout=1.0)
    return True


async def _cut_without_transport(send: Send, started: bool) -> None:
    # Fallback for servers other than uvicorn: promise more than we send and stop; the
    # server then closes the connection mid-body.
    if not started:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"1000000")]}
        )
    await send({"type": "http.response.body", "body": b"{", "more_body": True})


async def until_settled(ticket: Ticket, client: _Client) -> None:
    """Wait until the ticket's sequence is done, its client has gone or the engine failed it
    (what a whole, non-streamed answer waits for, on every endpoint)."""
    seq = ticket.seq
    while not seq.done and not client.gone and not ticket.failed:
        await ticket.wait()


class GenerationEndpoint:
    """``POST /v1/chat/completions`` (kind ``chat``) or ``POST /v1/completions`` (``completion``)."""

    def __init__(self, runtime: SimRuntime, kind: Kind) -> None:
        self.runtime = runtime
        self.kind = kind
        self._id_prefix = "chatcmpl-" if kind == "chat" else "cmpl-"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            body = error_body("Method Not Allowed", "MethodNotAllowed", 405)
            await send_json(send, 405, body, [(b"allow", b"POST")])
            return
        runtime, stats = self.runtime, self.runtime.stats
        try:
            raw = await _read_body(receive)
        except _BodyTooLargeError:
            stats.requests_invalid += 1
            body = error_body(f"Request body larger than {MAX_BODY_BYTES} bytes.", "BadRequestError", 413)
            await send_json(send, 413, body)
            return
        if raw is None:
            return
        config = runtime.config
        try:
            request = parse_generation(
                self.kind, raw, default_model=config.model, output_tokens=runtime.natural_length()
            )
        except BadRequestError as exc:
            stats.requests_invalid += 1
            await send_json(send, 400, error_body(exc.message, "BadRequestError", 400, exc.param))
            return
        stats.requests_received += 1
        plan = plan_faults(config, runtime.rng, max_tokens=request.max_tokens, stream=request.stream)

        if plan.error:
            stats.injected_errors += 1
            body = error_body(
                "Simulated internal server error (fault injection).", "InternalServerError", 500
            )
            await send_json(send, 500, body)
            return

        client = _Client(receive)
        ticket: Ticket | None = None
        try:
            if plan.first_byte_delay > 0:
                stats.injected_slow_first_byte += 1
                if await client.wait_gone(plan.first_byte_delay):
                    stats.requests_aborted += 1
                    return
            if plan.reset:
                stats.injected_resets += 1
                if not await _reset_connection(receive, client):
                    await _cut_without_transport(send, started=False)
                return
            request_id = self._id_prefix + uuid.uuid4().hex
            try:
                kv = config.kv_cache_tokens
                asked = request.limit or request.max_tokens
                if kv is not None and request.prompt_tokens + asked > kv:
                    # vLLM checks what was asked for against the context, not what it will make.
                    raise PromptTooLongError(request.prompt_tokens, asked, kv)
                ticket = runtime.submit(request_id, request)
            except QueueFullError:
                body = error_body(QUEUE_FULL_MESSAGE, "ServiceUnavailableError", 503)
                await send_json(send, 503, body)
                return
            except PromptTooLongError as exc:
                stats.requests_invalid += 1
                await send_json(send, 400, error_body(str(exc), "BadRequestError", 400))
                return
            client.ticket = ticket
            encoder = ResponseEncoder(
                request, request_id=request_id, created=int(time.time()), tokens=runtime.tokens
            )
            if request.stream:
                await self._stream(ticket, encoder, client, plan.cut_after, receive, send)
            else:
                await self._whole(ticket, encoder, client, send)
        finally:
            client.close()
            if ticket is not None:
                runtime.release(ticket, AbortReason.CLIENT_GONE)

    async def _whole(self, ticket: Ticket, encoder: ResponseEncoder, client: _Client, send: Send) -> None:
        seq = ticket.seq
        await until_settled(ticket, client)
        if seq.state is SeqState.FINISHED:
            await send_json(send, 200, encoder.full(seq.generated))
        elif ticket.failed and not client.gone:
            await send_json(send, 500, error_body("Simulator engine stopped.", "InternalServerError", 500))

    async def _stream(
        self,
        ticket: Ticket,
        encoder: ResponseEncoder,
        client: _Client,
        cut_after: int | None,
        receive: Receive,
        send: Send,
    ) -> None:
        seq = ticket.seq
        # vLLM's StreamingResponse sends its headers before the first token, even when queued.
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        sent = 0
        while True:
            if client.gone:
                return
            if ticket.failed:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            ready = seq.generated
            if ready <= sent:
                await ticket.wait()
                continue
            end = ready if cut_after is None else min(ready, cut_after)
            final = seq.state is SeqState.FINISHED and end == ready
            parts = [encoder.stream_start()] if sent == 0 else []
            parts.append(encoder.stream_tokens(sent, end, final=final))
            if final:
                parts.append(encoder.stream_end(end))
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": not final})
            sent = end
            if final:
                return
            if cut_after is not None and sent >= cut_after:
                self.runtime.stats.injected_stream_cuts += 1
                self.runtime.release(ticket, AbortReason.FAULT)
                if not await _reset_connection(receive, client):
                    await _cut_without_transport(send, started=True)
                return
