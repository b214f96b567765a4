"""Named engine profiles of ``llm-backoff-shim sim --profile NAME``: the simulator set up like a GPU box.

A profile is a set of defaults for the engine's flags; a flag given on the command line
wins over the profile's value. Both profiles model an 8B dense model in bfloat16
(Llama-3.1-8B-Instruct: 32 layers, 8 KV heads of 128, so 128 KiB of KV cache per token)
served by vLLM on one GPU, from public measurements:

- one sequence decodes at ~75 tokens/s on an A100 40GB (Llama-3.1-8B, vLLM 0.23; batching
  gives 6.6x at 8 sequences; johnmusgrave.com/p/vllm-throughput-latency-sweep-on) and at
  6.5 ms per token on an H100 80GB (vLLM 0.21; 1.38k tokens/s at 16 sequences;
  yobitelcomm.github.io/bench/recipes/concurrency-sweep); an H100 saturated by many
  sequences reaches several thousand tokens/s and up to ~12k with tuning
  (morphllm.com/vllm-benchmarks);
- vLLM's defaults for its OpenAI server (``EngineArgs.get_batch_defaults``): 256
  sequences and 2048 batched tokens per step, 1024 and 8192 on GPUs of 70 GiB or more
  other than the A100;
- prefill is compute-bound: 2 x 8e9 FLOP per token at roughly half of the GPU's bf16
  peak (312 TFLOP/s A100, 989 H100) is ~10k tokens/s on an A100 and ~25k on an H100;
- KV cache: vLLM gives ``--gpu-memory-utilization`` 0.9 of the GPU to the model, and
  what the 15 GiB of weights and the activations leave is cache: ~19 GiB (~150k tokens)
  on an A100 40GB, ~54 GiB (~440k tokens) on an H100 80GB. (A 24 GiB RTX 3090 reported
  3.8 GiB, 31k tokens, in vllm-project/vllm#10517.)

The step-time model is the simulator's (``sim.engine``): ``itl * (1 + factor *
(running - 1))`` per decode step, plus ``prefill_time_per_token`` per prompt token in
the step. The batch factors below put the full batch at the aggregate rate named in each
profile's summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final


@dataclass(frozen=True)
class SimProfile:
    """A named set of engine defaults (keys are ``SimConfig`` fields, i.e. the flags' dests)."""

    name: str
    summary: str
    defaults: MappingProxyType[str, object] = field(repr=False)

    def decode_tokens_per_s(self, running: int) -> float:
        """Answer tokens per second with ``running`` sequences decoding, no prefill in the steps."""
        itl = float(self._number("itl"))
        factor = float(self._number("itl_batch_factor"))
        return running / (itl * (1.0 + factor * (running - 1)))

    def _number(self, key: str) -> float:
        value = self.defaults[key]
        if not isinstance(value, (int, float)):  # pragma: no cover - the table below is numeric
            raise TypeError(f"{key} is not a number")
        return value


def _profile(name: str, summary: str, **defaults: object) -> SimProfile:
    return SimProfile(name, summary, MappingProxyType(defaults))


PROFILES: Final[MappingProxyType[str, SimProfile]] = MappingProxyType(
    {
        p.name: p
        for p in (
            _profile(
                "gpu-small",
                "an 8B model in bf16 on one A100 40GB: 128 sequences, 67 tokens/s alone, "
                "~2.5k tokens/s with 128 running, prefill 10k tokens/s, 150k tokens of KV cache",
                max_num_seqs=128,
                ttft=0.03,
                itl=0.015,
                itl_batch_factor=0.019,
                prefill_time_per_token=0.0001,
                max_num_batched_tokens=2048,
                kv_cache_tokens=150_000,
            ),
            _profile(
                "gpu-large",
                "an 8B model in bf16 on one H100 80GB: 256 sequences, 143 tokens/s alone, "
                "~6k tokens/s with 256 running, prefill 25k tokens/s, 440k tokens of KV cache",
                max_num_seqs=256,
                ttft=0.02,
                itl=0.007,
                itl_batch_factor=0.02,
                prefill_time_per_token=0.00004,
                max_num_batched_tokens=8192,
                kv_cache_tokens=440_000,
            ),
        )
    }
)
