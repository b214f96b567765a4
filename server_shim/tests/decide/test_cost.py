"""A request's cost from its body (decide/cost.py) and the cost budget's own rules (token_budget.py)."""

from __future__ import annotations

import pytest

from llm_backoff_shim.decide.cost import (
    BYTES_PER_TOKEN,
    MESSAGE_OVERHEAD,
    RequestCost,
    estimate_prompt_tokens,
    request_cost,
    text_tokens,
)
from llm_backoff_shim.decide.token_budget import TokenBudget


def test_text_counts_its_utf8_bytes_over_four_rounded_up() -> None:
    assert BYTES_PER_TOKEN == 4
    assert [text_tokens(t) for t in ("", "a", "abcd", "abcde")] == [0, 1, 1, 2]
    # Non-ASCII text counts its encoded bytes: "é" is 2 bytes, "日本" 6.
    assert text_tokens("é" * 4) == 2
    assert text_tokens("日本") == 2


def test_chat_messages_count_their_text_and_a_template_overhead_each() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "x" * 40},
            {"role": "user", "content": [{"type": "text", "text": "y" * 8}, {"type": "image_url"}]},
            {"role": "assistant", "content": None},
        ]
    }
    assert estimate_prompt_tokens(body) == 10 + 2 + 3 * MESSAGE_OVERHEAD


def test_completion_prompts_count_text_token_ids_and_batches() -> None:
    assert estimate_prompt_tokens({"prompt": "z" * 100}) == 25
    assert estimate_prompt_tokens({"prompt": [5, 6, 7]}) == 3
    assert estimate_prompt_tokens({"prompt": ["abcd", [1, 2], "ab"]}) == 1 + 2 + 1
    # What the engine will refuse costs nothing here: it never holds a cache.
    assert estimate_prompt_tokens({"prompt": {"not": "a prompt"}}) == 0
    assert estimate_prompt_tokens({"prompt": [True, False]}) == 0
    assert estimate_prompt_tokens({}) == 0


def test_anthropic_responses_and_embedding_bodies_count_their_text_too() -> None:
    anthropic = {"system": "s" * 8, "messages": [{"role": "user", "content": "u" * 8}], "max_tokens": 10}
    assert request_cost(anthropic, 512) == RequestCost(2 + 2 + MESSAGE_OVERHEAD, 10)
    responses = {"instructions": "i" * 4, "input": "q" * 40, "max_output_tokens": 7}
    assert request_cost(responses, 512) == RequestCost(1 + 10, 7)
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "t" * 12}]}]}
    assert estimate_prompt_tokens(items) == 3 + MESSAGE_OVERHEAD
    assert estimate_prompt_tokens({"input": ["abcd", "abcdefgh"]}) == 3
    assert estimate_prompt_tokens({"input": [3, 4, 5, 6]}) == 4


def test_the_cost_is_prompt_plus_the_answers_limit_or_the_default() -> None:
    chat = {"messages": [{"role": "user", "content": "q" * 400}]}
    assert request_cost(chat, 512) == RequestCost(100 + MESSAGE_OVERHEAD, 512)
    assert request_cost({**chat, "max_tokens": 64}, 512).tokens == 104 + 64
    # max_completion_tokens wins, as the engine reads it; a non-number is no limit.
    assert request_cost({**chat, "max_tokens": 64, "max_completion_tokens": 32}, 512).max_tokens == 32
    assert request_cost({**chat, "max_tokens": "64"}, 512).max_tokens == 512
    assert request_cost({**chat, "max_tokens": True}, 512).max_tokens == 512
    with pytest.raises(ValueError, match="default_max_tokens"):
        request_cost(chat, -1)


def test_the_budget_fits_within_it_or_alone() -> None:
    budget = TokenBudget(1000)
    assert budget.fits(0, 400)
    assert budget.fits(600, 400)
    assert not budget.fits(601, 400)
    # Bigger than the whole budget: admitted only when nothing holds any of it.
    assert budget.fits(0, 5000)
    assert not budget.fits(1, 5000)
    with pytest.raises(ValueError, match=">= 1"):
        TokenBudget(0)


def test_a_request_stands_for_its_cost_in_slot_shares_within_one_and_the_cap() -> None:
    budget = TokenBudget(8000)  # at a cap of 8: 1000 tokens a slot's share
    assert [budget.places(c, 8) for c in (0, 1, 1000, 1001, 3000, 1_000_000)] == [1, 1, 1, 2, 3, 8]
    # The share follows the cap (an adaptive limit moves it).
    assert budget.places(3000, 4) == 2
