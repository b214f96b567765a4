"""The engine's answer tokens/s with every slot busy, for this workload's lengths.

A closed loop of ``slots`` workers straight at the engine, each sending the next request
(lengths drawn from the workload, seeded) when its last one ends, for ``seconds``; the
rate is the answer tokens of the requests that completed (``usage.completion_tokens``)
over the time from the first start to the last end. It is what the engine can do, read
independently of ``calibrate``'s knee, so the load can be set at a true multiple of it.
"""

from __future__ import annotations

import asyncio
import random
import time

import openai

from llm_backoff_shim.workload import Workload


async def _measure(url: str, model: str, workload: Workload, slots: int, seconds: float, seed: int) -> float:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
    rng = random.Random(seed)
    tokens = 0
    last_end = 0.0
    start = time.monotonic()
    stop = start + seconds

    async def worker() -> None:
        nonlocal tokens, last_end
        while time.monotonic() < stop:
            prompt, max_tokens = workload.draw(rng)
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": workload.ignore_eos},
            )
            async with stream:
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
            last_end = time.monotonic()

    try:
        await asyncio.gather(*(worker() for _ in range(slots)))
    finally:
        await client.close()
    return tokens / (last_end - start) if last_end > start else 0.0


def full_load_tokens_per_s(
    url: str, model: str, workload: Workload, *, slots: int, seconds: float, seed: int = 0
) -> float:
    return asyncio.run(_measure(url, model, workload, slots, seconds, seed))
