"""The simulator's Anthropic Messages endpoint, ``POST /v1/messages``, as vLLM serves it.

A messages request occupies an engine slot exactly as a chat completion does (same
:class:`~llm_backoff_shim.sim.runtime.SimRuntime`, same queue, same ``503`` "Request queue
full." when the engine's waiting queue is full) and is aborted when its client goes.
Answers follow Anthropic's wire format: a ``message`` object, or with ``"stream": true``
the SSE events ``message_start``, ``content_block_start``, ``content_block_delta`` (one
per token), ``content_block_stop``, ``message_delta`` (stop reason and output tokens) and
``message_stop``. Errors are Anthropic-shaped: ``{"type": "error", "error": {"type",
"message"}}``. The fault-injection knobs act on the OpenAI endpoints only.

The text is the simulator's filler, ``"token0 token1 ..."``; ``stop_reason`` is
``max_tokens`` when the request's ``max_tokens`` cut it short, ``end_turn`` otherwise.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.types import Receive, Scope, Send

from .endpoints import (
    MAX_BODY_BYTES,
    QUEUE_FULL_MESSAGE,
    _BodyTooLargeError,
    _Client,
    _read_body,
    send_json,
    until_settled,
)
from .engine import AbortReason, QueueFullError, SeqState
from .protocol import GenerationRequest, TokenTable
from .runtime import SimRuntime, Ticket

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class AnthropicBadRequestError(Exception):
    """A messages request the simulator refuses with a 400 ``invalid_request_error``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def anthropic_error(kind: str, message: str) -> bytes:
    return json.dumps(
        {"type": "error", "error": {"type": kind, "message": message}}, separators=(",", ":")
    ).encode()


def _tokens_of(text: str) -> int:
    return max(1, (len(text) + 3) // 4)  # about four characters a token, as sim_protocol counts


def _content_tokens(content: Any, where: str) -> int:
    if isinstance(content, str):
        return _tokens_of(content)
    if isinstance(content, list):
        total = 0
        for block in content:
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise AnthropicBadRequestError(
                    f"{where}: each content block must be an object with a `type`."
                )
            if isinstance(block.get("text"), str):
                total += _tokens_of(block["text"])
        return total
    raise AnthropicBadRequestError(f"{where}: `content` must be a string or a list of content blocks.")


def parse_messages(raw: bytes, *, default_model: str, output_tokens: int) -> tuple[GenerationRequest, bool]:
    """Validate a ``/v1/messages`` body: the engine request, and whether ``max_tokens`` limits it.

    Raises :class:`AnthropicBadRequestError` with an Anthropic-style message for anything malformed.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AnthropicBadRequestError(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise AnthropicBadRequestError("The request body must be a JSON object.")
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise AnthropicBadRequestError("`model` must be a non-empty string.")
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise AnthropicBadRequestError(f"`max_tokens` must be a positive integer, got {limit!r}.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicBadRequestError("`messages` must be a non-empty list of messages.")
    prompt = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise AnthropicBadRequestError(f"messages.{i}: `role` must be 'user' or 'assistant'.")
        prompt += _content_tokens(message.get("content"), f"messages.{i}") + 4
    system = body.get("system")
    if system is not None:
        prompt += _content_tokens(system, "system")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise AnthropicBadRequestError("`stream` must be a boolean.")
    limited = limit < output_tokens
    request = GenerationRequest(
        kind="chat",
        model=model,
        stream=stream,
        include_usage=False,
        max_tokens=limit if limited else output_tokens,
        finish_reason="length" if limited else "stop",
        prompt_tokens=prompt,
    )
    return request, limited


def _event(name: str, data: dict[str, Any]) -> bytes:
    return (
        b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    )


class MessageEncoder:
    """Bytes of one messages answer, streamed (Anthropic SSE events) or whole."""

    def __init__(
        self, request: GenerationRequest, *, message_id: str, stop_reason: str, tokens: TokenTable
    ) -> None:
        self._request = request
        self._id = message_id
        self._stop_reason = stop_reason
        self._tokens = tokens
        self._delta = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,' + (
            b'"delta":{"type":"text_delta","text":'
        )

    def _message(self, text: str | None, output_tokens: int) -> dict[str, Any]:
        request = self._request
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": request.model,
            "content": [] if text is None else [{"type": "text", "text": text}],
            "stop_reason": None if text is None else self._stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": request.prompt_tokens, "output_tokens": output_tokens},
        }

    def full(self, output_tokens: int) -> bytes:
        message = self._message(self._tokens.joined(output_tokens), output_tokens)
        return json.dumps(message, separators=(",", ":")).encode()

    def stream_start(self) -> bytes:
        return _event("message_start", {"type": "message_start", "message": self._message(None, 0)}) + _event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )

    def stream_tokens(self, start: int, end: int) -> bytes:
        return b"".join(self._delta + self._tokens.json(i) + b"}}\n\n" for i in range(start, end))

    def stream_end(self, output_tokens: int) -> bytes:
        delta = {"stop_reason": self._stop_reason, "stop_sequence": None}
        return (
            _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _event(
                "message_delta",
                {"type": "message_delta", "delta": delta, "usage": {"output_tokens": output_tokens}},
            )
            + _event("message_stop", {"type": "message_stop"})
        )


class MessagesEndpoint:
    """``POST /v1/messages`` on the simulator's engine."""

    def __init__(self, runtime: SimRuntime) -> None:
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            body = anthropic_error("invalid_request_error", "Method Not Allowed")
            await send_json(send, 405, body, [(b"allow", b"POST")])
            return
        runtime, stats = self.runtime, self.runtime.stats
        try:
            raw = await _read_body(receive)
        except _BodyTooLargeError:
            stats.requests_invalid += 1
            body = anthropic_error("request_too_large", f"Request body larger than {MAX_BODY_BYTES} bytes.")
            await send_json(send, 413, body)
            return
        if raw is None:
            return
        config = runtime.config
        try:
            request, limited = parse_messages(
                raw, default_model=config.model, output_tokens=runtime.natural_length()
            )
        except AnthropicBadRequestError as exc:
            stats.requests_invalid += 1
            await send_json(send, 400, anthropic_error("invalid_request_error", exc.message))
            return
        stats.requests_received += 1
        client = _Client(receive)
        ticket: Ticket | None = None
        message_id = "msg_" + uuid.uuid4().hex
        try:
            try:
                ticket = runtime.submit(message_id, request)
            except QueueFullError:
                await send_json(send, 503, anthropic_error("overloaded_error", QUEUE_FULL_MESSAGE))
                return
            client.ticket = ticket
            encoder = MessageEncoder(
                request,
                message_id=message_id,
                stop_reason="max_tokens" if limited else "end_turn",
                tokens=runtime.tokens,
            )
            if request.stream:
                await _stream(ticket, encoder, client, send)
            else:
                await _whole(ticket, encoder, client, send)
        finally:
            client.close()
            if ticket is not None:
                runtime.release(ticket, AbortReason.CLIENT_GONE)


async def _whole(ticket: Ticket, encoder: MessageEncoder, client: _Client, send: Send) -> None:
    seq = ticket.seq
    await until_settled(ticket, client)
    if seq.state is SeqState.FINISHED:
        await send_json(send, 200, encoder.full(seq.generated))
    elif ticket.failed and not client.gone:
        await send_json(send, 500, anthropic_error("api_error", "Simulator engine stopped."))


async def _stream(ticket: Ticket, encoder: MessageEncoder, client: _Client, send: Send) -> None:
    seq = ticket.seq
    # As for chat: the headers go out before the first token, even while queued.
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    sent = 0
    while True:
        if client.gone:
            return
        if ticket.failed:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        ready = seq.generated
        final = seq.state is SeqState.FINISHED
        if ready <= sent and not final:
            await ticket.wait()
            continue
        parts = [encoder.stream_start()] if sent == 0 else []
        parts.append(encoder.stream_tokens(sent, ready))
        if final:
            parts.append(encoder.stream_end(ready))
        await send({"type": "http.response.body", "body": b"".join(parts), "more_body": not final})
        sent = ready
        if final:
            return
