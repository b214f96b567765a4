"""bench/real_vllm/mix.py: the long-prompt mix's trace; the engine model playing capacity and the oracle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from llm_backoff_shim.sim.engine import EngineParams
from real_vllm.mix import Budgets, Mix, MixCall, capacity, mix_trace, oracle

ENGINE = EngineParams(
    max_num_seqs=4,
    ttft=0.02,
    itl=0.01,
    itl_batch_factor=0.0,
    prefill_time_per_token=0.0001,
    prefill_attention_time=0.0001,
    max_num_batched_tokens=2048,
)


def test_the_trace_is_seeded_and_mixes_chat_with_long_prompts_and_a_burst() -> None:
    mix = Mix(long_share=0.2, tokens_per_word=1.4)
    trace = mix_trace(mix, 3, rate=20.0, duration=30.0, burst=6, burst_at=10.0)
    assert trace == mix_trace(mix, 3, rate=20.0, duration=30.0, burst=6, burst_at=10.0)
    assert [c.at for c in trace] == sorted(c.at for c in trace)
    assert [c.index for c in trace] == list(range(len(trace)))
    steady = [c for c in trace if not c.burst]
    longs = [c for c in steady if c.kind == "long"]
    assert 0.1 < len(longs) / len(steady) < 0.3
    burst = [c for c in trace if c.burst]
    assert len(burst) == 6
    assert all(c.kind == "long" and c.at == 10.0 for c in burst)
    for c in trace:
        if c.kind == "long":
            assert 1500 - 2 <= c.prompt_tokens <= 3000 + 2
        else:
            assert c.prompt_tokens <= 300


def test_capacity_of_chat_is_more_calls_than_of_long_prompts() -> None:
    mix = Mix()
    chat_calls, chat_tokens = capacity(ENGINE, mix, seconds=120, only="chat")
    long_calls, _ = capacity(ENGINE, mix, seconds=120, only="long")
    assert chat_calls > 2 * long_calls
    # 4 sequences decoding at 100 tokens/s each bound the answer rate from above.
    assert 0 < chat_tokens < 400


def _call(index: int, at: float, kind: str, prompt: int, answer: int) -> MixCall:
    return MixCall(index, at, kind, prompt_words=prompt, prompt_tokens=prompt, max_tokens=answer)  # type: ignore[arg-type]


def test_the_oracle_serves_everything_when_the_engine_keeps_up() -> None:
    calls = [_call(i, i * 1.0, "chat", 50, 20) for i in range(10)]
    out = oracle(calls, ENGINE, Budgets())
    assert out.served == {"chat": 10}
    assert out.useful_tokens == 200
    assert max(out.chat_ttfts) < 0.1


def test_the_oracle_serves_chat_before_long_prompts_whose_deadline_is_later() -> None:
    """Two slots' worth of long prompts and chat arriving together: chat must start within
    its budget, the long prompts can wait; nothing is started that cannot be useful."""
    engine = EngineParams(max_num_seqs=1, ttft=0.0, itl=0.1)
    calls = [_call(0, 0.0, "long", 2000, 30), _call(1, 0.0, "chat", 10, 30), _call(2, 0.0, "chat", 10, 30)]
    out = oracle(calls, engine, Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=60.0))
    assert out.served == {"chat": 2, "long": 1}
    assert out.chat_ttfts[0] == pytest.approx(0.0, abs=1e-6)


def test_the_oracle_drops_what_cannot_be_useful_and_counts_no_tokens_for_it() -> None:
    engine = EngineParams(max_num_seqs=1, ttft=0.0, itl=1.0)
    # Each chat holds the only slot ~9 s; the second cannot start within its 5 s budget.
    calls = [_call(0, 0.0, "chat", 10, 10), _call(1, 0.0, "chat", 10, 10)]
    out = oracle(calls, engine, Budgets(chat_ttft=5.0, chat_deadline=20.0))
    assert out.served == {"chat": 1}
    assert out.useful_tokens == 10
    assert out.generated == 10


def test_short_chat_beside_batch_gives_batch_chats_lengths_and_a_burst_of_both_kinds() -> None:
    """The scoreboard's chat and burst scenarios: the second kind (batch) has chat's lengths,
    and a burst drawn in the mix's proportion rather than all long prompts."""
    mix = Mix(long_share=0.3, tokens_per_word=1.4, long_prompts=False)
    trace = mix_trace(mix, 5, rate=20.0, duration=20.0, burst=40, burst_at=5.0, burst_kind=None)
    steady = [c for c in trace if not c.burst]
    batch = [c for c in steady if c.kind == "long"]
    assert 0.2 < len(batch) / len(steady) < 0.4
    assert all(c.prompt_words <= 200 and c.max_tokens <= 512 for c in trace)
    burst = [c for c in trace if c.burst]
    assert len(burst) == 40
    assert {c.kind for c in burst} == {"chat", "long"}
    assert all(c.at == 5.0 for c in burst)
    assert mix.mean_answer_tokens() == Mix(long_share=0.0).mean_answer_tokens()


def test_the_scoreboard_plays_each_call_with_max_tokens_4096_or_none_and_its_drawn_answer() -> None:
    import scoreboard

    mix = Mix(long_share=0.2, tokens_per_word=1.4)
    trace = mix_trace(mix, 11, rate=10.0, duration=10.0)
    calls = scoreboard.arrivals(trace, 11)
    assert calls == scoreboard.arrivals(trace, 11)
    assert {a.max_tokens for a in calls} == {4096, None}
    assert [a.answer_tokens for a in calls] == [c.max_tokens for c in trace]
    assert [a.cls for a in calls] == ["interactive" if c.kind == "chat" else "batch" for c in trace]
    assert all(a.ignore_eos and a.prompt for a in calls)
