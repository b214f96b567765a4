"""OpenAI wire format for the simulator: request parsing and response/chunk encoding (pure).

Responses follow vLLM's OpenAI server: ``chat.completion`` / ``chat.completion.chunk``
and ``text_completion`` objects, ``usage`` in non-streamed answers and, when
``stream_options.include_usage`` is true, in a final chunk with empty ``choices``,
then ``data: [DONE]``. Errors use vLLM's shape:
``{"error": {"message", "type", "param", "code": <HTTP status>}}``.

Prompt tokens are estimated without a tokenizer: 1.3 tokens per word, a word being a run
of letters and digits or a punctuation mark (English text through the usual BPE
tokenizers averages about that); token-id prompts count exactly. Each chat message adds 4
for its role and the template's separators.

Answer length: with vLLM's extra parameter ``ignore_eos`` and a ``max_tokens`` (or
``max_completion_tokens``), exactly that many tokens (finish_reason ``length``); otherwise
the request's natural length (drawn by the caller of :func:`parse_generation`), cut to
``max_tokens`` when that is smaller (``length``), else ``stop``.

The generated text is deterministic filler: ``"token0 token1 token2 ..."``, one word per
token. A chat request with vLLM's ``continue_final_message: true`` continues its final
assistant message as vLLM does: the filler goes on after that message's words (a prefill
of ``"token0 token1"`` is continued with ``" token2 token3 ..."``). Streaming chunks are
assembled from pre-encoded byte pieces so a token costs a few ``bytes`` joins, not a
``json.dumps``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["chat", "completion"]

SSE_DONE = b"data: [DONE]\n\n"


class BadRequestError(Exception):
    """A request the simulator refuses with a 400 OpenAI-format error."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}},
        separators=(",", ":"),
    ).encode()


@dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int
    finish_reason: str
    prompt_tokens: int
    ignore_eos: bool = False
    limit: int | None = None
    """The request's ``max_completion_tokens``/``max_tokens`` as sent (None: not sent)."""
    first_token: int = 0
    """The filler's first token index: the words of a final assistant message continued."""


TOKENS_PER_WORD = 1.3
_PIECES = re.compile(r"\w+|[^\w\s]")


def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` by the module doc's estimate (at least 1)."""
    return max(1, math.ceil(TOKENS_PER_WORD * len(_PIECES.findall(text))))


def _optional_positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequestError(f"`{name}` must be a positive integer, got {value!r}.", param=name)
    return value


def _chat_prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("`messages` must be a non-empty list of messages.", param="messages")
    total = 0
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequestError("Each message must be an object with a string `role`.", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            total += estimate_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += estimate_tokens(part["text"])
        elif content is not None:
            raise BadRequestError(
                "Message `content` must be a string, a list of parts or null.", param="messages"
            )
        total += 4  # role and separators of the chat template
    return total


def _completion_prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return estimate_tokens(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return len(prompt)
    raise BadRequestError(
        "`prompt` must be a string or a list of token ids (one prompt per request in the simulator).",
        param="prompt",
    )


def tokenize_count(raw: bytes) -> int:
    """Tokens of a ``POST /tokenize`` body (vLLM's: a ``prompt``, or chat ``messages``), counted as
    a generation request's prompt is."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    if "messages" in body:
        return _chat_prompt_tokens(body)
    return _completion_prompt_tokens(body)


def parse_generation(kind: Kind, raw: bytes, *, default_model: str, output_tokens: int) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` or ``/v1/completions`` body.

    ``output_tokens`` is this request's natural answer length (module doc).

    Raises :class:`BadRequestError` with an OpenAI-style message for anything malformed.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")

    model = body.get("model")
    if model is None:
        model = default_model
    elif not isinstance(model, str) or not model:
        raise BadRequestError("`model` must be a non-empty string.", param="model")

    prompt_tokens = _chat_prompt_tokens(body) if kind == "chat" else _completion_prompt_tokens(body)

    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise BadRequestError("`stream` must be a boolean.", param="stream")

    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise BadRequestError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        if not isinstance(options, dict):
            raise BadRequestError("`stream_options` must be an object.", param="stream_options")
        flag = options.get("include_usage")
        if flag is not None and not isinstance(flag, bool):
            raise BadRequestError("`stream_options.include_usage` must be a boolean.", param="stream_options")
        include_usage = bool(flag)

    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequestError("The simulator generates one choice per request; `n` must be 1.", param="n")

    ignore_eos = body.get("ignore_eos")
    if ignore_eos is None:
        ignore_eos = False
    elif not isinstance(ignore_eos, bool):
        raise BadRequestError("`ignore_eos` must be a boolean.", param="ignore_eos")

    limit: int | None = None
    if kind == "chat":
        limit = _optional_positive_int(body, "max_completion_tokens")
    if limit is None:
        limit = _optional_positive_int(body, "max_tokens")
    if limit is not None and (ignore_eos or limit < output_tokens):
        max_tokens, finish_reason = limit, "length"
    else:
        max_tokens, finish_reason = output_tokens, "stop"

    first_token = 0
    messages = body.get("messages")
    if (
        kind == "chat"
        and body.get("continue_final_message") is True
        and isinstance(messages, list)
        and messages
    ):
        last = messages[-1]
        if (
            isinstance(last, dict)
            and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)
        ):
            first_token = len(last["content"].split())

    return GenerationRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        ignore_eos=ignore_eos,
        limit=limit,
        first_token=first_token,
    )


class TokenTable:
    """The filler text per token index, as text and as a JSON string literal (memoised)."""

    def __init__(self) -> None:
        self._json: list[bytes] = []

    @staticmethod
    def text(index: int) -> str:
        return f"token{index}" if index == 0 else f" token{index}"

    def json(self, index: int) -> bytes:
        table = self._json
        while len(table) <= index:
            table.append(json.dumps(self.text(len(table))).encode())
        return table[index]

    def joined(self, count: int, first: int = 0) -> str:
        return "".join(self.text(i) for i in range(first, first + count))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class ResponseEncoder:
    """Bytes of one request's answer, streamed (SSE) or whole."""

    def __init__(
        self, request: GenerationRequest, *, request_id: str, created: int, tokens: TokenTable
    ) -> None:
        self._request = request
        self._id = request_id
        self._created = created
        self._tokens = tokens
        chat = request.kind == "chat"
        self._object = "chat.completion.chunk" if chat else "text_completion"
        head = (
            f'data: {{"id":{json.dumps(request_id)},"object":"{self._object}",'
            f'"created":{created},"model":{json.dumps(request.model)},"choices":[{{"index":0,'
        ).encode()
        self._head = head
        self._open = head + (b'"delta":{"content":' if chat else b'"text":')
        close = b"}," if chat else b","
        self._close = close + b'"logprobs":null,"finish_reason":null}]}\n\n'
        self._close_final = close + b'"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n'

    def stream_start(self) -> bytes:
        """What precedes the first token: the assistant role chunk (chat) or nothing."""
        if self._request.kind != "chat":
            return b""
        return (
            self._head
            + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def stream_tokens(self, start: int, end: int, *, final: bool) -> bytes:
        """SSE events for tokens ``start..end-1``; with ``final`` the last one carries finish_reason."""
        parts: list[bytes] = []
        last = end - 1
        first = self._request.first_token
        for i in range(start, end):
            parts.append(self._open)
            parts.append(self._tokens.json(first + i))
            if final and i == last:
                parts.append(self._close_final % self._request.finish_reason.encode())
            else:
                parts.append(self._close)
        return b"".join(parts)

    def stream_end(self, completion_tokens: int) -> bytes:
        """The optional usage chunk and the ``[DONE]`` terminator."""
        if not self._request.include_usage:
            return SSE_DONE
        usage = {
            "id": self._id,
            "object": self._object,
            "created": self._created,
            "model": self._request.model,
            "choices": [],
            "usage": _usage(self._request.prompt_tokens, completion_tokens),
        }
        return b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n" + SSE_DONE

    def full(self, completion_tokens: int) -> bytes:
        """The non-streamed answer with ``completion_tokens`` tokens of filler text."""
        request = self._request
        text = self._tokens.joined(completion_tokens, request.first_token)
        choice: dict[str, Any]
        if request.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": request.finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": request.finish_reason,
                "stop_reason": None,
            }
            obj = "text_completion"
        body = {
            "id": self._id,
            "object": obj,
            "created": self._created,
            "model": request.model,
            "choices": [choice],
            "usage": _usage(request.prompt_tokens, completion_tokens),
        }
        return json.dumps(body, separators=(",", ":")).encode()
