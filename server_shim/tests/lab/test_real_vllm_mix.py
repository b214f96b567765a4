"""bench/real_vllm/mix.py: the long-prompt mix's trace; the engine model playing capacity and the oracle."""

from __future__ import annotations

import math
import random
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


def test_a_named_workload_draws_each_kinds_lengths_in_the_engines_tokens_and_shares_prefixes() -> None:
    from llm_backoff_shim.lab.workloads import named_workload

    mix = Mix(long_share=0.3, tokens_per_word=2.0, workload=named_workload("bimodal"))
    trace = mix_trace(mix, 7, rate=20.0, duration=20.0)
    chat = [c for c in trace if c.kind == "chat"]
    batch = [c for c in trace if c.kind == "long"]
    assert 0.2 < len(batch) / len(trace) < 0.4
    # 100 prefix tokens and 50 (1,024) own at 2 tokens a word, plus the chat template's.
    assert {(c.prefix_words, c.prompt_words, c.prompt_tokens, c.max_tokens) for c in chat} == {
        (50, 25, 158, 50)
    }
    assert {(c.prefix_words, c.prompt_words, c.prompt_tokens, c.max_tokens) for c in batch} == {
        (50, 512, 1132, 512)
    }
    rng = random.Random(0)
    prompts = {(c.prefix_group, c.prompt(rng)) for c in chat[:40]}
    assert {g for g, _ in prompts} == {0, 1}
    for group in (0, 1):
        heads = {" ".join(p.split()[:50]) for g, p in prompts if g == group}
        assert len(heads) == 1  # one shared system prompt per group
    assert len({" ".join(p.split()[50:]) for _, p in prompts}) == len(prompts)  # each question its own
    assert mix.mean_answer_tokens() == pytest.approx(0.7 * 50 + 0.3 * 512)


def test_the_batch_gateways_interactive_calls_burst_then_trickle_beside_steady_batch() -> None:
    from llm_backoff_shim.lab.workloads import named_workload

    mix = Mix(long_share=0.3, workload=named_workload("batch-gateway"))
    trace = mix_trace(mix, 3, rate=10.0, duration=60.0)
    assert trace == mix_trace(mix, 3, rate=10.0, duration=60.0)
    assert [c.at for c in trace] == sorted(c.at for c in trace)

    def count(kind: str, first_half: bool) -> int:
        return sum(1 for c in trace if c.kind == kind and (c.at < 30.0) == first_half)

    # Poisson counts within 5 standard deviations of their means: chat at 7/s x 15/8 then
    # 7/s x 1/8, batch at 3/s all along, 30 s each half.
    for kind, first_half, per_s in (
        ("chat", True, 7 * 15 / 8),
        ("chat", False, 7 / 8),
        ("long", True, 3.0),
        ("long", False, 3.0),
    ):
        expected = per_s * 30
        assert abs(count(kind, first_half) - expected) < 5 * math.sqrt(expected)
    assert all(
        c.max_tokens == 128 and c.prompt_tokens == round(round(512 / 1.45) * 1.45) + 8
        for c in trace
        if c.kind == "chat"
    )
    assert max(c.max_tokens for c in trace if c.kind == "long") <= 2048


@pytest.mark.parametrize("name", ["shared-prefix", "bimodal", "batch-gateway"])
def test_each_named_workload_is_a_scoreboard_scenario_the_oracle_can_play(name: str) -> None:
    import scoreboard

    spec = scoreboard.SCENARIOS[name]
    assert spec.mix.workload is not None
    assert spec.mix.workload.name == name == spec.calibration
    trace = mix_trace(spec.mix, 11, rate=6.0, duration=5.0)
    out = oracle(trace, ENGINE, spec.budgets)
    assert sum(out.offered.values()) == len(trace) > 0
    assert out.useful_tokens > 0
    assert all(c.prompt_tokens + c.max_tokens <= scoreboard.MAX_MODEL_LEN for c in trace)
