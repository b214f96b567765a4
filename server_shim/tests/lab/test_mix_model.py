"""The mix (lab/workload.py) and the mix in virtual time (lab/mix_model.py): small, seeded runs."""

from __future__ import annotations

import random

import pytest

from llm_backoff_shim.decide.cost import estimate_prompt_tokens
from llm_backoff_shim.lab.mix_model import mix_arrivals, run_mix
from llm_backoff_shim.lab.workload import CHAT_AND_LONG, LengthDist, Mix, MixPart, Workload
from llm_backoff_shim.sim.engine import EngineParams

ENGINE = EngineParams(
    max_num_seqs=32,
    ttft=0.05,
    itl=0.02,
    itl_batch_factor=0.01,
    prefill_time_per_token=0.0001,
    kv_cache_tokens=16384,
)
SHIM = ["--classes", "interactive,batch", "--max-queue", "200"]
SHIM += ["--class-max-queue-wait", "interactive=5,batch=60"]


def test_a_mix_draws_its_parts_by_share_and_checks_itself() -> None:
    rng = random.Random(1)
    names = [CHAT_AND_LONG.pick(rng).name for _ in range(2000)]
    assert 0.75 < names.count("chat") / len(names) < 0.85
    part, text, max_tokens = CHAT_AND_LONG.draw(random.Random(2))
    assert part.cls in ("interactive", "batch")
    assert text
    assert max_tokens >= 1
    assert "80% chat (interactive, 5 s TTFT budget)" in CHAT_AND_LONG.describe()
    with pytest.raises(ValueError, match="add up to 1"):
        Mix((MixPart("a", 0.5, Workload(), "interactive"),))
    with pytest.raises(ValueError, match="distinct"):
        Mix((MixPart("a", 0.5, Workload(), "x"), MixPart("a", 0.5, Workload(), "y")))


def test_the_long_prompts_are_priced_from_their_text() -> None:
    arrivals = mix_arrivals(CHAT_AND_LONG, 5.0, 20.0, random.Random(3))
    longs = [a for a in arrivals if a.part.name == "long"]
    chats = [a for a in arrivals if a.part.name == "chat"]
    assert longs
    assert chats
    # 1,150-2,300 words: the engine counts 1.3 a word; the shim estimates from the text.
    assert all(1500 <= a.prompt_tokens <= 3100 for a in longs)
    assert all(a.body()["max_tokens"] == a.max_tokens for a in arrivals)
    assert max(estimate_prompt_tokens(a.body()) for a in chats) < min(
        estimate_prompt_tokens(a.body()) for a in longs
    )


def test_a_burst_of_long_prompts_waits_in_the_shim_under_a_cost_budget() -> None:
    chat = CHAT_AND_LONG.part("chat")
    chat_only = Mix((MixPart("chat", 1.0, chat.workload, chat.cls, chat.ttft_budget),))
    long_ = MixPart("long", 1.0, Workload(LengthDist.fixed(1500), LengthDist.fixed(100)), "batch")
    arrivals = mix_arrivals(chat_only, 4.0, 20.0, random.Random(4), burst=(5.0, 30, long_))
    direct = run_mix(arrivals, ENGINE, None, 20.0)
    capped = run_mix(arrivals, ENGINE, [*SHIM, "--max-concurrency", "32"], 20.0)
    budgeted = [*SHIM, "--max-concurrency", "32", "--max-inflight-tokens", "8000"]
    budget = run_mix(arrivals, ENGINE, budgeted, 20.0)
    chats = len(budget.by_part["chat"])
    ok = [r.count("chat", lambda c: c.useful) for r in (direct, capped, budget)]
    # Straight to the engine or through a request cap sized for chat, the burst makes chat late;
    # with the budget every chat call is served in time and every long prompt is served too.
    assert ok[2] == chats
    assert ok[0] < chats
    assert ok[1] < chats
    assert budget.count("long", lambda c: c.useful) == 30
    assert budget.useful_tokens > max(direct.useful_tokens, capped.useful_tokens)
    for result in (direct, capped, budget):
        assert all(c.outcome != "pending" for c in result.calls)
