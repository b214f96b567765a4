"""Token estimate before sending, and usage read back after (JSON and SSE tails)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from llm_backoff.tokens import (
    CHARS_PER_TOKEN,
    MEDIA_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    REPLY_PRIMING_TOKENS,
    estimate_request_tokens,
    estimate_tokens,
    usage_tokens,
)


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def chat(*contents: str, **extra: Any) -> bytes:
    return body({"model": "m", "messages": [{"role": "user", "content": c} for c in contents], **extra})


def framing(n_messages: int) -> int:
    return MESSAGE_OVERHEAD_TOKENS * n_messages + REPLY_PRIMING_TOKENS


def test_chat_prompt_is_characters_over_four_plus_framing_plus_max_tokens() -> None:
    text = "x" * 401
    got = estimate_tokens(chat(text, max_tokens=50))
    # "user" role strings are text sent to the model too: 4 chars each.
    chars = 401 + len("user")
    assert got == math.ceil(chars / CHARS_PER_TOKEN) + framing(1) + 50


def test_completion_allowance_precedence_and_n() -> None:
    base = estimate_tokens(chat("hi", max_tokens=1))
    assert estimate_tokens(chat("hi", max_tokens=1, max_completion_tokens=100)) == base - 1 + 100
    assert estimate_tokens(chat("hi", max_tokens=100, n=3)) == base - 1 + 300
    assert estimate_tokens(chat("hi"), default_max_tokens=777) == base - 1 + 777
    # Garbage values fall back to the default, never crash.
    assert estimate_tokens(chat("hi", max_tokens="many", n=-2), default_max_tokens=5) == base - 1 + 5


def test_model_name_and_settings_are_not_prompt() -> None:
    short = estimate_tokens(body({"model": "m", "prompt": "abcd", "max_tokens": 1}))
    long = estimate_tokens(body({"model": "m" * 4000, "user": "u" * 400, "prompt": "abcd", "max_tokens": 1}))
    assert short == long == 1 + 1


def test_images_cost_a_flat_amount_whatever_their_size() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}
    msg = {"role": "user", "content": [{"type": "text", "text": "abcd"}, image]}
    got = estimate_tokens(body({"model": "m", "messages": [msg], "max_tokens": 1}))
    text_chars = len("user") + len("text") + len("abcd")
    assert got == math.ceil(text_chars / 4) + MEDIA_TOKENS + framing(1) + 1


def test_pretokenised_prompt_counts_one_token_per_id() -> None:
    assert estimate_tokens(body({"prompt": [1, 2, 3, 4, 5], "max_tokens": 2})) == 5 + 2


def test_embeddings_generate_nothing() -> None:
    req = body({"model": "e", "input": ["a" * 40, "b" * 40]})
    assert estimate_tokens(req, path="/v1/embeddings") == 20
    assert estimate_tokens(req, path="/v1/completions", default_max_tokens=10) == 30


def test_responses_api_fields() -> None:
    req = body({"model": "m", "instructions": "a" * 8, "input": "b" * 8, "max_output_tokens": 9})
    assert estimate_tokens(req) == 2 + 2 + 9


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (chat("hello there", "and more", max_tokens=50, n=2), "/v1/chat/completions"),
        (body({"model": "m", "prompt": [1, 2, 3], "max_tokens": 7}), "/v1/completions"),
        (body({"model": "m", "input": ["a" * 40, "b" * 8]}), "/v1/embeddings"),
        (body({"model": "m", "input": [{"type": "input_image", "image_url": "x"}]}), "/v1/responses"),
    ],
)
def test_an_already_parsed_body_is_priced_the_same(raw: bytes, path: str) -> None:
    # Servers that parse a body once (the shim) price the parsed object.
    assert estimate_request_tokens(json.loads(raw), path=path) == estimate_tokens(raw, path=path) > 0


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b"\xff\xfe", b'"str"'])
def test_non_json_bodies_cost_nothing(raw: bytes) -> None:
    assert estimate_tokens(raw) == 0


def test_usage_from_json_response() -> None:
    resp = {
        "id": "x",
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42},
    }
    assert usage_tokens(body(resp)) == 42
    assert usage_tokens(body({"usage": {"input_tokens": 5, "output_tokens": 7}})) == 12
    assert usage_tokens(body({"usage": None})) is None
    assert usage_tokens(body({"choices": []})) is None


def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_usage_from_sse_tail_uses_last_event_with_usage() -> None:
    chunk = {"choices": [{"delta": {"content": "hi"}}], "usage": None}
    final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    stream = sse(chunk, chunk, final)
    assert usage_tokens(stream) == 7
    # The tail handed over may start mid-event.
    assert usage_tokens(stream[len(stream) // 3 :]) == 7
    assert usage_tokens(sse(chunk, chunk)) is None


def test_usage_from_responses_api_stream() -> None:
    done = {"type": "response.completed", "response": {"usage": {"input_tokens": 10, "output_tokens": 5}}}
    assert usage_tokens(b"event: response.completed\n" + sse({"type": "x"}, done)) == 15


@pytest.mark.parametrize(
    "raw",
    [None, b"", b"{", b'data: {"usage": {"total_tokens": ', b'{"usage": {"total_tokens": -3}}', b"\x00\xff"],
)
def test_usage_garbage_is_none(raw: bytes | None) -> None:
    assert usage_tokens(raw) is None
