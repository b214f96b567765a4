"""What a body says of a request's cost (decide/cost.py) and the cost budget's own rules (token_budget.py)."""

from __future__ import annotations

import pytest

from llm_backoff_shim.decide.cost import (
    BYTES_PER_TOKEN,
    MESSAGE_OVERHEAD,
    SAMPLE_TEXT,
    answer_limit,
    bytes_per_token,
    estimate_prompt_tokens,
    text_tokens,
)
from llm_backoff_shim.decide.token_budget import TokenBudget


def test_text_counts_its_utf8_bytes_over_four_rounded_up() -> None:
    assert BYTES_PER_TOKEN == 4
    assert [text_tokens(t) for t in ("", "a", "abcd", "abcde")] == [0, 1, 1, 2]
    # Non-ASCII text counts its encoded bytes: "é" is 2 bytes, "日本" 6.
    assert text_tokens("é" * 4) == 2
    assert text_tokens("日本") == 2


def test_text_counts_at_the_engines_ratio_once_known() -> None:
    # A small-vocabulary model's 2.5 bytes a token: 10 bytes are 4 tokens, not 3.
    assert text_tokens("abcdefghij", 2.5) == 4
    body = {"messages": [{"role": "user", "content": "x" * 100}]}
    assert estimate_prompt_tokens(body, 2.0) == 50 + MESSAGE_OVERHEAD
    assert estimate_prompt_tokens({"prompt": "z" * 100}, 5.0) == 20


def test_the_ratio_comes_from_the_engines_count_of_the_sample_and_must_be_plausible() -> None:
    size = len(SAMPLE_TEXT.encode())
    assert bytes_per_token(SAMPLE_TEXT, 100) == size / 100
    # No count, a count of more tokens than bytes, or one token per 16+ bytes: not this text's.
    for count in (0, -3, size + 1, size // 17):
        assert bytes_per_token(SAMPLE_TEXT, count) is None
    assert bytes_per_token(SAMPLE_TEXT, True) is None


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
    assert (estimate_prompt_tokens(anthropic), answer_limit(anthropic)) == (2 + 2 + MESSAGE_OVERHEAD, 10)
    responses = {"instructions": "i" * 4, "input": "q" * 40, "max_output_tokens": 7}
    assert (estimate_prompt_tokens(responses), answer_limit(responses)) == (1 + 10, 7)
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "t" * 12}]}]}
    assert estimate_prompt_tokens(items) == 3 + MESSAGE_OVERHEAD
    assert estimate_prompt_tokens({"input": ["abcd", "abcdefgh"]}) == 3
    assert estimate_prompt_tokens({"input": [3, 4, 5, 6]}) == 4


def test_the_answers_limit_is_the_first_the_body_names() -> None:
    chat = {"messages": [{"role": "user", "content": "q" * 400}]}
    assert answer_limit(chat) is None
    assert answer_limit({**chat, "max_tokens": 64}) == 64
    # max_completion_tokens wins, as the engine reads it; a non-number is no limit.
    assert answer_limit({**chat, "max_tokens": 64, "max_completion_tokens": 32}) == 32
    assert answer_limit({**chat, "max_tokens": "64"}) is None
    assert answer_limit({**chat, "max_tokens": True}) is None
    assert answer_limit({**chat, "max_tokens": 0}) is None


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
