"""Calibrate's requests (I/O): streamed chat completions of the mix, timed chunk by chunk.

:class:`Driver` sends the probe and the closed loop's requests
(:mod:`~llm_backoff_shim.lab.calibrate_loop`) through one ``AsyncOpenAI`` client, each
registered as :class:`~llm_backoff_shim.lab.calibrate_loop.Live` while it runs, and returns
a :class:`~llm_backoff_shim.lab.calibrate_samples.Sample` when it ends or fails.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import openai

from .calibrate_cost import CostMeter
from .calibrate_loop import Live
from .calibrate_samples import Sample
from .workload import prompt_text

if TYPE_CHECKING:
    from .calibrate_ramp import CalibrateConfig


def _has_content(delta: Any) -> bool:
    if delta is None:
        return False
    # vLLM streams reasoning models' thinking in reasoning_content (older) or reasoning.
    return any(
        getattr(delta, name, None) for name in ("content", "reasoning_content", "reasoning", "tool_calls")
    )


def error_text(exc: BaseException) -> str:
    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {exc.message}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def streaming_http_client(pool: int) -> Any:
    """The SDK's default async HTTP client with a pool wide enough for ``pool`` streams.

    openai's default keeps 100 idle connections; above that, each new request would
    pay a TCP connect inside its measured TTFT. openai 3.x runs on httpx2, 2.x on httpx.
    """
    if int(openai.__version__.split(".")[0]) >= 3:
        import httpx2 as httplib
    else:  # pragma: no cover - exercised by the openai 2.x environment
        import httpx as httplib  # type: ignore[no-redef]
    limits = httplib.Limits(max_connections=pool + 16, max_keepalive_connections=pool + 16)
    return openai.DefaultAsyncHttpxClient(limits=limits)


@dataclass
class Driver:
    """Sends calibrate's requests through one ``AsyncOpenAI`` client, lengths drawn from the mix."""

    client: openai.AsyncOpenAI
    model: str
    config: CalibrateConfig
    clock: Callable[[], float]
    rng: random.Random = field(default_factory=random.Random)
    #: Prompt words sent and prompt tokens the upstream counted for them, so far: a running
    #: request's cost is estimated at this ratio until its own count arrives.
    words_sent: int = 0
    tokens_counted: int = 0
    #: Prices requests as the shim's cost cap does (calibrate_cost.py); made from the mix.
    costs: CostMeter | None = None

    def __post_init__(self) -> None:
        if self.costs is None:
            self.costs = CostMeter(self.clock, round(self.config.output_tokens.mean()))

    def prompt_tokens(self, words: int) -> int:
        """The upstream's likely count for a prompt of ``words`` words."""
        if self.words_sent <= 0 or self.tokens_counted <= 0:
            return words
        return round(words * self.tokens_counted / self.words_sent)

    def draw(self) -> tuple[int, int]:
        """One request's prompt words and ``max_tokens``, from the mix."""
        cfg = self.config
        long = cfg.long_share > 0 and self.rng.random() < cfg.long_share
        words = (cfg.long_prompt_words if long else cfg.prompt_words).draw(self.rng)
        return words, cfg.output_tokens.draw(self.rng)

    async def probe(self) -> Sample:
        """One request of the mix's mean lengths, alone: how long a request takes."""
        words = max(1, round(self.config.mean_prompt_words()))
        max_tokens = max(1, round(self.config.output_tokens.mean()))
        return await self.one_request(0, -1, {}, lengths=(words, max_tokens))

    async def one_request(
        self,
        worker: int,
        seq: int,
        live: dict[tuple[int, int], Live],
        lengths: tuple[int, int] | None = None,
    ) -> Sample:
        """One streamed request, registered in ``live`` while it runs (its chunks' times too)."""
        cfg = self.config
        words, max_tokens = lengths or self.draw()
        prompt = prompt_text(words, self.rng)
        extra: dict[str, object] = {"ignore_eos": True} if cfg.ignore_eos else {}
        start = self.clock()
        costs = self.costs
        assert costs is not None
        # Priced when it starts, as the shim prices at admission (calibrate_cost.py).
        answer = costs.answer()
        running = Live(worker, seq, start, self.prompt_tokens(words) + answer)
        live[(worker, seq)] = running
        times = running.token_times
        usage: Any = None
        try:
            stream = await self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                temperature=0,
                extra_body=extra or None,
            )
            async with stream:
                async for chunk in stream:
                    now = self.clock()
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if any(_has_content(choice.delta) for choice in chunk.choices):
                        times.append(now)
        except Exception as exc:  # a load generator records any failure and carries on
            return Sample(
                worker, seq, start, self.clock(), ok=False, error=error_text(exc), cost=running.cost
            )
        finally:
            live.pop((worker, seq), None)
        end = self.clock()
        tokens = int(getattr(usage, "completion_tokens", 0) or len(times))
        prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
        if prompt_tokens:
            self.words_sent += words
            self.tokens_counted += prompt_tokens
        costs.observe(tokens)
        first = times[0] if times else None
        itl = None
        if first is not None and tokens >= 2 and times[-1] > first:
            itl = (times[-1] - first) / (tokens - 1)
        return Sample(
            worker,
            seq,
            start,
            end,
            ok=True,
            first_token=first,
            itl=itl,
            output_tokens=tokens,
            prompt_tokens=prompt_tokens,
            cost=(prompt_tokens or self.prompt_tokens(words)) + answer,
            token_times=tuple(times),
        )
