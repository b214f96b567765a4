"""Configuration of the vLLM-like simulator (re-exported as ``llm_backoff_shim.sim.server.SimConfig``)."""

from __future__ import annotations

import math
import random

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llm_backoff_shim.sim.engine import EngineParams


class SimConfig(BaseModel):
    """Validated settings of ``llm-backoff-shim sim``.

    Behaviour chosen where vLLM has no equivalent or a test double should be easier:

    - Any ``model`` name in a request is accepted and echoed back (vLLM would answer 404
      for a name it does not serve); ``model`` is what ``/v1/models`` lists and what a
      request without a ``model`` field reports.
    - A request's natural answer length is drawn from a lognormal with median
      ``output_tokens`` and log-space spread ``output_tokens_sigma``, clamped to
      ``1..output_tokens_max`` (8 x the median when unset); ``output_tokens_sigma`` 0 (the
      default here, which tests want; the ``sim`` command defaults to 0.8) makes every
      natural answer exactly ``output_tokens`` long. A request's
      ``max_completion_tokens``/``max_tokens``, when smaller, cuts it short (finish_reason
      ``length``); with ``ignore_eos`` it is the exact length. Draws come from their own
      ``random.Random(seed)``, apart from the fault draws.
    - Prefill costs ``prefill_time_per_token`` of engine step time per prompt token, plus
      ``prefill_attention_time`` per token per 1000 tokens of context before it, in
      chunks of ``max_num_batched_tokens`` shared with the decode tokens, and ``admit_time``
      once per request with its first chunk (``sim_engine``).
    - ``kv_cache_tokens`` bounds the prompt + generated tokens of the running requests;
      when full, the youngest is preempted and recomputed later, as vLLM does. A request
      whose prompt + ``max_tokens`` exceeds it gets vLLM's 400 (context length).
    - ``max_num_queued_reqs`` counts running + waiting requests, as vLLM's flag does; a
      request that would exceed it gets vLLM's 503 with no Retry-After.
    - Faults are drawn per request from ``random.Random(seed)``: first one of
      ``error_rate`` (HTTP 500) / ``reset_rate`` (TCP reset before any byte), then
      independently ``slow_first_byte_rate`` (hold the response ``slow_first_byte_delay``
      seconds before its headers) and, for streams, ``stream_cut_rate`` (reset the
      connection after a random number of tokens).
    """

    # A number field refuses inf and nan (as ShimSettings does).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model: str = Field(default="sim-model", min_length=1, description="model name served")
    max_num_seqs: int = Field(default=8, ge=1, le=100_000, description="max sequences running at once")
    max_num_queued_reqs: int | None = Field(
        default=None, ge=1, description="max unfinished (running + waiting) requests; None = unbounded"
    )
    ttft: float = Field(default=0.2, ge=0, le=3600, description="seconds from admission to the first token")
    itl: float = Field(
        default=0.025, ge=0, le=3600, description="seconds between tokens with one sequence running"
    )
    itl_batch_factor: float = Field(
        default=0.05, ge=0, le=100, description="itl grows by this fraction per extra running sequence"
    )
    output_tokens: int = Field(default=40, ge=1, le=1_000_000, description="median natural answer length")
    output_tokens_sigma: float = Field(
        default=0.0, ge=0, le=5, description="log-space spread of natural answer lengths (0 = fixed)"
    )
    output_tokens_max: int | None = Field(
        default=None, ge=1, le=1_000_000, description="longest natural answer (None = 8 x output_tokens)"
    )
    prefill_time_per_token: float = Field(
        default=0.0002, ge=0, le=10, description="engine step seconds per prompt token"
    )
    prefill_attention_time: float = Field(
        default=0.0,
        ge=0,
        le=10,
        description="engine step seconds per prompt token per 1000 tokens of context before it",
    )
    admit_time: float = Field(
        default=0.0,
        ge=0,
        le=60,
        description="engine step seconds each request costs once, with its first prefill chunk",
    )
    decode_attention_time: float = Field(
        default=0.0,
        ge=0,
        le=10,
        description="decode step seconds per 1000 tokens in the decoding sequences' KV cache",
    )
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, le=10_000_000, description="tokens per engine step (decode + prefill chunk)"
    )
    kv_cache_tokens: int | None = Field(
        default=None, ge=2, description="KV-cache size in tokens; None = unbounded (no preemption)"
    )
    error_rate: float = Field(default=0.0, ge=0, le=1, description="fraction answered with HTTP 500")
    reset_rate: float = Field(default=0.0, ge=0, le=1, description="fraction whose connection is reset")
    slow_first_byte_rate: float = Field(
        default=0.0, ge=0, le=1, description="fraction with a delayed first byte"
    )
    slow_first_byte_delay: float = Field(default=1.0, ge=0, le=3600, description="that delay, seconds")
    stream_cut_rate: float = Field(default=0.0, ge=0, le=1, description="fraction of streams cut mid-way")
    seed: int | None = Field(default=None, description="seed of the fault draws (None = random)")

    @model_validator(mode="after")
    def _rates_fit(self) -> SimConfig:
        if self.error_rate + self.reset_rate > 1.0:
            raise ValueError("error_rate + reset_rate must not exceed 1")
        if self.output_tokens_max is not None and self.output_tokens_max < self.output_tokens:
            raise ValueError("output_tokens_max must be >= output_tokens")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        return self

    @property
    def longest_natural_answer(self) -> int:
        return self.output_tokens_max if self.output_tokens_max is not None else 8 * self.output_tokens

    def natural_length(self, rng: random.Random) -> int:
        """One request's natural answer length (see the class doc)."""
        if self.output_tokens_sigma == 0:
            return self.output_tokens
        value = rng.lognormvariate(math.log(self.output_tokens), self.output_tokens_sigma)
        return min(self.longest_natural_answer, max(1, round(value)))

    def engine_params(self, *, tick_slack: float = 0.0) -> EngineParams:
        """The engine model these settings describe (the server's, and the benchmarks' oracle's)."""
        return EngineParams(
            max_num_seqs=self.max_num_seqs,
            ttft=self.ttft,
            itl=self.itl,
            itl_batch_factor=self.itl_batch_factor,
            max_num_queued_reqs=self.max_num_queued_reqs,
            tick_slack=tick_slack,
            prefill_time_per_token=self.prefill_time_per_token,
            prefill_attention_time=self.prefill_attention_time,
            admit_time=self.admit_time,
            decode_attention_time=self.decode_attention_time,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_tokens=self.kv_cache_tokens,
        )
