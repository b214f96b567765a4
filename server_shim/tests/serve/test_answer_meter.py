"""Counting a relayed answer's tokens (serve/request_path/answer_meter.py): usage when the answer
carries it, a stream's events otherwise, nothing when neither tells."""

from __future__ import annotations

import json

from llm_backoff_shim.serve.request_path.answer_meter import TAIL_BYTES, AnswerMeter


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def fed(*chunks: bytes) -> AnswerMeter:
    meter = AnswerMeter()
    for chunk in chunks:
        meter.feed(chunk)
    return meter


def test_a_whole_answer_counts_its_usage() -> None:
    body = {
        "choices": [{"message": {"content": "x" * 5000}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 42},
    }
    raw = json.dumps(body).encode()
    assert fed(raw[:100], raw[100:]).tokens(event_stream=False) == 42
    # Responses and Anthropic name it output_tokens.
    assert fed(b'{"usage": {"input_tokens": 3, "output_tokens": 7}}').tokens(event_stream=False) == 7
    # No usage in a whole answer: nothing to learn.
    assert fed(b'{"choices": []}').tokens(event_stream=False) is None


def test_a_stream_counts_its_usage_chunk_or_else_its_token_events() -> None:
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    tokens = [{"choices": [{"delta": {"content": f" t{i}"}}]} for i in range(30)]
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 30}}
    with_usage = sse(role, *tokens, usage)
    assert (
        fed(*[with_usage[i : i + 50] for i in range(0, len(with_usage), 50)]).tokens(event_stream=True) == 30
    )
    # Without usage: the events less the role chunk and [DONE].
    assert fed(sse(role, *tokens)).tokens(event_stream=True) == 30
    assert fed(b"").tokens(event_stream=True) is None


def test_only_the_tail_is_kept() -> None:
    meter = fed(b"a" * 10 * TAIL_BYTES, b'{"usage": {"completion_tokens": 3}}')
    assert len(meter.tail) <= TAIL_BYTES
    assert meter.tokens(event_stream=False) == 3
