"""Probe an engine's prefill and decode costs: the figures the simulator's flags model.

    .venv/bin/python bench/real_vllm/probe.py --url http://127.0.0.1:8000 [--out probe.json]

Against any OpenAI-compatible engine that takes token-id prompts on ``/v1/completions``
(vLLM, the simulator), streaming, ``ignore_eos``, one process on loopback:

1. TTFT of a prompt of P tokens alone (P = 50, 500, 1500, 2500), and beside 4 chats
   decoding: the fixed part of TTFT (``--ttft``) and the prefill cost per token
   (``--prefill-time-per-token``), and what decoding neighbours add;
2. the gap between tokens with B sequences decoding (B = 1, 2, 4, 8): ``--itl`` and
   ``--itl-batch-factor``;
3. 4 chats decoding, then a 2500-token prompt arrives: the chats' longest gap between
   tokens while it prefills, against their median gap (how the prefill shares the steps:
   ``--max-num-batched-tokens``, the chunk size).

``--context-sweep`` instead: the gap between tokens with 8 sequences decoding after prompts of
20-3000 tokens (attention reads every sequence's whole context at each step:
``--decode-attention-time``).

Each figure is the median of ``--repeats`` tries. Prompts are distinct token ids so no
prefix cache can serve them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llm_backoff_shim.lab.workload import WORDS

PROMPT_LENGTHS = (50, 500, 1500, 2500)
BATCHES = (1, 2, 4, 8)
CONTEXTS = (20, 1000, 2000, 3000)


@dataclass
class Stream:
    """One streamed completion: when it was sent and when each token arrived."""

    sent: float
    arrivals: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    def gaps(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False) if since <= b <= until]


class Engine:
    def __init__(self, url: str, model: str, vocab: int, seed: int, *, chat: bool = False) -> None:
        self.client = httpx.AsyncClient(base_url=url, timeout=300)
        self.chat = chat
        self.model = model
        self.vocab = vocab
        self.rng = random.Random(seed)

    def prompt(self, tokens: int) -> list[int]:
        # Ids above the special ones, random: no two prompts share a prefix.
        return [self.rng.randrange(10, self.vocab) for _ in range(tokens)]

    def body(self, prompt_tokens: int, max_tokens: int) -> tuple[str, dict[str, object]]:
        """The path and body of a streamed request; ``chat``: the load generator's own kind (a chat
        message of words, ~1.35 tokens each with this model's tokenizer)."""
        common = {"model": self.model, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        if self.chat:
            words = max(1, round(prompt_tokens / 1.35))
            text = " ".join(self.rng.choice(WORDS) for _ in range(words))
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
        return "/v1/completions", {**common, "prompt": self.prompt(prompt_tokens), "temperature": 0}

    async def complete(self, prompt_tokens: int, max_tokens: int) -> Stream:
        path, body = self.body(prompt_tokens, max_tokens)
        stream = Stream(time.perf_counter())
        async with self.client.stream("POST", path, json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                choices = data.get("choices") or []
                if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                    stream.arrivals.append(time.perf_counter())
        return stream

    async def close(self) -> None:
        await self.client.aclose()


async def ttft_alone(engine: Engine, tokens: int) -> float:
    return (await engine.complete(tokens, 2)).ttft


async def ttft_beside_chats(engine: Engine, tokens: int, chats: int = 4) -> float:
    neighbours = [asyncio.create_task(engine.complete(20, 400)) for _ in range(chats)]
    await asyncio.sleep(1.0)  # the chats are decoding
    probe = await engine.complete(tokens, 2)
    for task in neighbours:
        task.cancel()
    await asyncio.gather(*neighbours, return_exceptions=True)
    return probe.ttft


async def decode_gap(engine: Engine, batch: int, tokens: int = 48, context: int = 20) -> float:
    streams = await asyncio.gather(*(engine.complete(context, tokens) for _ in range(batch)))
    gaps = [g for s in streams for g in s.gaps()[4:]]  # past the first tokens, every stream decoding
    return statistics.median(gaps)


async def chat_gaps_during_long(engine: Engine, tokens: int = 2500, chats: int = 4) -> dict[str, float]:
    """The chats' gaps between tokens before, and while, a long prompt is prefilled."""
    recorded: list[Stream] = []

    async def chat() -> None:
        body_stream = Stream(time.perf_counter())
        recorded.append(body_stream)
        path, body = engine.body(20, 400)
        async with engine.client.stream("POST", path, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    body_stream.arrivals.append(time.perf_counter())

    tasks = [asyncio.create_task(chat()) for _ in range(chats)]
    await asyncio.sleep(1.5)
    long = await engine.complete(tokens, 2)
    await asyncio.sleep(0.3)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    before = [g for s in recorded for g in s.gaps(since=long.sent - 1.0, until=long.sent)]
    during = [g for s in recorded for g in s.gaps(since=long.sent, until=long.arrivals[0])]
    return {
        "long_ttft": long.ttft,
        "chat_gap_before": statistics.median(before),
        "chat_gap_max_during": max(during) if during else float("nan"),
        "chat_tokens_during": len(during) / chats,
    }


async def context_sweep(engine: Engine, repeats: int) -> dict[str, float]:
    """The gap between tokens with 8 sequences decoding, each after a prompt of N tokens."""
    gaps: dict[str, float] = {}
    for context in CONTEXTS:
        gaps[str(context)] = statistics.median(
            [await decode_gap(engine, 8, 64, context) for _ in range(repeats)]
        )
        print(
            f"  8 decoding after {context:4}-token prompts: {gaps[str(context)] * 1000:.1f} ms between tokens"
        )
    return gaps


async def probe(args: argparse.Namespace) -> dict[str, object]:
    engine = Engine(args.url, args.model, args.vocab, args.seed, chat=args.chat)
    out: dict[str, object] = {"url": args.url}
    if args.context_sweep:
        try:
            await engine.complete(20, 4)
            out["decode_gap_8_by_context"] = await context_sweep(engine, args.repeats)
        finally:
            await engine.close()
        return out
    try:
        await engine.complete(20, 4)  # warm-up
        alone: dict[int, float] = {}
        beside: dict[int, float] = {}
        for tokens in PROMPT_LENGTHS:
            alone[tokens] = statistics.median([await ttft_alone(engine, tokens) for _ in range(args.repeats)])
            beside[tokens] = statistics.median(
                [await ttft_beside_chats(engine, tokens) for _ in range(args.repeats)]
            )
            print(
                f"  prompt {tokens:5}: TTFT alone {alone[tokens]:.3f} s, "
                f"beside 4 chats {beside[tokens]:.3f} s"
            )
        gap: dict[int, float] = {}
        for batch in BATCHES:
            gap[batch] = statistics.median([await decode_gap(engine, batch) for _ in range(args.repeats)])
            print(
                f"  {batch} decoding: {gap[batch] * 1000:.1f} ms between tokens, "
                f"{batch / gap[batch]:.0f} tokens/s"
            )
        during = [await chat_gaps_during_long(engine) for _ in range(args.repeats)]
        summary = {key: statistics.median(d[key] for d in during) for key in during[0]}
        print(
            f"  a 2500-token prompt among 4 chats: its TTFT {summary['long_ttft']:.3f} s; the chats' gap "
            f"{summary['chat_gap_before'] * 1000:.0f} ms before, longest "
            f"{summary['chat_gap_max_during'] * 1000:.0f} ms during its prefill "
            f"({summary['chat_tokens_during']:.1f} tokens each meanwhile)"
        )
        out.update(
            ttft_alone={str(k): v for k, v in alone.items()},
            ttft_beside_4_chats={str(k): v for k, v in beside.items()},
            decode_gap={str(k): v for k, v in gap.items()},
            long_among_chats=summary,
        )
    finally:
        await engine.close()
    return out


def fit(result: dict[str, object]) -> dict[str, float]:
    """Least-squares lines: TTFT alone over prompt length, the gap over batch size."""
    alone = {int(k): float(v) for k, v in result["ttft_alone"].items()}  # type: ignore[attr-defined]
    gap = {int(k): float(v) for k, v in result["decode_gap"].items()}  # type: ignore[attr-defined]
    slope, intercept = statistics.linear_regression(list(alone), list(alone.values()))
    g_slope, g_intercept = statistics.linear_regression(list(gap), list(gap.values()))
    itl = g_intercept + g_slope
    return {
        "prefill_time_per_token": slope,
        "ttft_fixed": intercept,
        "itl": itl,
        "itl_batch_factor": g_slope / itl,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the first /v1/models lists)")
    parser.add_argument("--vocab", type=int, default=3000, help="token ids are drawn below this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--chat",
        action="store_true",
        help="chat completions with text prompts (the benchmarks' kind) instead of token-id completions",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--context-sweep",
        action="store_true",
        help="instead: the gap between tokens of 8 sequences decoding after prompts of 20-3000 tokens",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.model is None:
        args.model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    result = asyncio.run(probe(args))
    if args.context_sweep:
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    result["fit"] = fit(result)
    print("fit: " + ", ".join(f"{k} {v:.6g}" for k, v in result["fit"].items()))  # type: ignore[attr-defined]
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
