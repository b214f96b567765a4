"""Simulator wire format (parsing, SSE encoding) and fault draws: pure functions."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from pydantic import ValidationError

from llm_backoff_shim.sim.faults import NO_FAULT, plan_faults
from llm_backoff_shim.sim.protocol import (
    BadRequestError,
    GenerationRequest,
    ResponseEncoder,
    TokenTable,
    parse_generation,
)
from llm_backoff_shim.sim.server import SimConfig


def chat(body: dict[str, Any], output_tokens: int = 40) -> GenerationRequest:
    return parse_generation(
        "chat", json.dumps(body).encode(), default_model="sim", output_tokens=output_tokens
    )


MSG = [{"role": "user", "content": "hello there"}]


def test_chat_defaults() -> None:
    req = chat({"messages": MSG})
    assert req.model == "sim"
    assert (req.stream, req.include_usage) == (False, False)
    assert (req.max_tokens, req.finish_reason) == (40, "stop")
    assert req.prompt_tokens > 0


@pytest.mark.parametrize(
    ("extra", "max_tokens", "finish"),
    [
        ({"max_tokens": 5}, 5, "length"),
        ({"max_completion_tokens": 7, "max_tokens": 3}, 7, "length"),
        ({"max_tokens": 40}, 40, "stop"),
        ({"max_tokens": 500}, 40, "stop"),
        ({"max_tokens": None}, 40, "stop"),
    ],
)
def test_a_smaller_request_limit_cuts_the_answer(extra: dict[str, Any], max_tokens: int, finish: str) -> None:
    req = chat({"messages": MSG, **extra})
    assert (req.max_tokens, req.finish_reason) == (max_tokens, finish)


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (b"{not json", None, "Invalid JSON"),
        (b"\xff\xfe", None, "Invalid JSON"),
        (b"[1, 2]", None, "JSON object"),
        (b"{}", "messages", "messages"),
        (b'{"messages": []}', "messages", "messages"),
        (b'{"messages": ["hi"]}', "messages", "role"),
        (b'{"messages": [{"role": "user", "content": 3}]}', "messages", "content"),
        (b'{"messages": [{"role": "user"}], "max_tokens": 0}', "max_tokens", "positive"),
        (b'{"messages": [{"role": "user"}], "max_tokens": true}', "max_tokens", "positive"),
        (b'{"messages": [{"role": "user"}], "stream": "yes"}', "stream", "boolean"),
        (
            b'{"messages": [{"role": "user"}], "stream_options": {"include_usage": true}}',
            "stream_options",
            "stream=True",
        ),
        (b'{"messages": [{"role": "user"}], "n": 2}', "n", "n"),
        (b'{"messages": [{"role": "user"}], "model": 5}', "model", "model"),
    ],
)
def test_malformed_chat_requests_get_a_clear_error(raw: bytes, param: str | None, fragment: str) -> None:
    with pytest.raises(BadRequestError) as info:
        parse_generation("chat", raw, default_model="sim", output_tokens=10)
    assert info.value.param == param
    assert fragment in info.value.message


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [("abcdefgh", 2), (["abcd"], 2), (["two words."], 4), ([1, 2, 3], 3), ([[5, 6]], 2)],
)
def test_completion_prompts(prompt: Any, tokens: int) -> None:
    req = parse_generation(
        "completion", json.dumps({"prompt": prompt}).encode(), default_model="m", output_tokens=4
    )
    assert req.prompt_tokens == tokens


@pytest.mark.parametrize("prompt", [None, [], ["a", "b"], [1, "x"], 7])
def test_bad_completion_prompts(prompt: Any) -> None:
    with pytest.raises(BadRequestError) as info:
        parse_generation(
            "completion", json.dumps({"prompt": prompt}).encode(), default_model="m", output_tokens=4
        )
    assert info.value.param == "prompt"


def sse_events(data: bytes) -> list[Any]:
    events = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_chat_stream_bytes_are_valid_sse_and_match_the_whole_answer() -> None:
    req = chat({"messages": MSG, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4})
    tokens = TokenTable()
    enc = ResponseEncoder(req, request_id="chatcmpl-x", created=123, tokens=tokens)
    data = enc.stream_start() + enc.stream_tokens(0, 3, final=False) + enc.stream_tokens(3, 4, final=True)
    data += enc.stream_end(4)
    events = sse_events(data)

    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": req.prompt_tokens, "completion_tokens": 4,
                                    "total_tokens": req.prompt_tokens + 4}  # fmt: skip
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-x" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]

    whole = json.loads(enc.full(4))
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == text == "token0 token1 token2 token3"
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 4


def test_a_final_assistant_message_is_continued_as_vllm_continues_it() -> None:
    prefill = [*MSG, {"role": "assistant", "content": "token0 token1 token2"}]
    body = {"messages": prefill, "stream": True, "max_tokens": 2}
    continued = chat({**body, "continue_final_message": True, "add_generation_prompt": False})
    enc = ResponseEncoder(continued, request_id="chatcmpl-x", created=123, tokens=TokenTable())
    chunks = sse_events(enc.stream_start() + enc.stream_tokens(0, 2, final=True))
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == " token3 token4"
    assert json.loads(enc.full(2))["choices"][0]["message"]["content"] == " token3 token4"
    assert chat(body).first_token == 0  # without the flag the assistant message is a finished turn


def test_completion_stream_without_usage_ends_with_done_only() -> None:
    req = parse_generation(
        "completion",
        b'{"prompt": "hi", "stream": true, "model": "x\\"y"}',
        default_model="m",
        output_tokens=2,
    )
    enc = ResponseEncoder(req, request_id="cmpl-1", created=1, tokens=TokenTable())
    events = sse_events(enc.stream_start() + enc.stream_tokens(0, 2, final=True) + enc.stream_end(2))
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["token0", " token1"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(e["model"] == 'x"y' and e["object"] == "text_completion" for e in events[:-1])


def test_zero_fault_rates_draw_nothing() -> None:
    rng = random.Random(1)
    state = rng.getstate()
    assert plan_faults(SimConfig(), rng, max_tokens=10, stream=True) is NO_FAULT
    assert rng.getstate() == state


def test_fault_draws_follow_the_rates_and_the_seed() -> None:
    config = SimConfig(error_rate=0.2, reset_rate=0.1, slow_first_byte_rate=0.3, stream_cut_rate=0.5)
    plans = [plan_faults(config, random.Random(7), max_tokens=10, stream=True) for _ in range(2)]
    assert plans[0] == plans[1]

    rng = random.Random(42)
    draws = [plan_faults(config, rng, max_tokens=10, stream=True) for _ in range(4000)]
    errors = sum(p.error for p in draws) / len(draws)
    resets = sum(p.reset for p in draws) / len(draws)
    slow = sum(p.first_byte_delay > 0 for p in draws) / len(draws)
    assert not any(p.error and p.reset for p in draws)
    assert errors == pytest.approx(0.2, abs=0.03)
    assert resets == pytest.approx(0.1, abs=0.03)
    assert slow == pytest.approx(0.3, abs=0.03)
    cuts = [p.cut_after for p in draws if p.cut_after is not None]
    assert all(1 <= c <= 9 for c in cuts)
    assert not any(p.cut_after is not None and (p.error or p.reset) for p in draws)


def test_stream_cuts_only_apply_to_streams_that_can_be_cut() -> None:
    config = SimConfig(stream_cut_rate=1.0)
    assert plan_faults(config, random.Random(0), max_tokens=10, stream=False) is NO_FAULT
    assert plan_faults(config, random.Random(0), max_tokens=1, stream=True) is NO_FAULT
    assert plan_faults(config, random.Random(0), max_tokens=2, stream=True).cut_after == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"ttft": -1},
        {"itl": float("inf")},
        {"error_rate": 1.5},
        {"error_rate": 0.6, "reset_rate": 0.6},
        {"max_num_queued_reqs": 0},
        {"output_tokens": 0},
        {"unknown": 1},
    ],
)
def test_invalid_configs_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        SimConfig(**kwargs)
