"""The engine's answer tokens/s with every slot busy, for this workload's lengths: ``slots``
workers straight at the engine, each sending its next request (seeded lengths) when the last
ends; after a warm-up second, vLLM's ``vllm:generation_tokens_total`` over a fixed window of
``seconds``. Read independently of ``calibrate``'s knee, so the load can be a true multiple of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import httpx
import openai

from llm_backoff_shim.lab.loadgen_engine import GENERATED, metric_sum
from llm_backoff_shim.lab.workload import Workload

WARM_UP = 1.0


async def _generated(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url + "/metrics")).text
    value = metric_sum(text, GENERATED)
    if value is None:
        raise RuntimeError(f"{url}/metrics has no {GENERATED}: not a vLLM?")
    return value


async def _measure(url: str, model: str, workload: Workload, slots: int, seconds: float, seed: int) -> float:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
    rng = random.Random(seed)

    async def worker() -> None:
        while True:
            prompt, max_tokens = workload.draw(rng)
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": workload.ignore_eos},
            )
            async with stream:
                async for _ in stream:
                    pass

    loop = asyncio.get_running_loop()
    workers = [asyncio.create_task(worker()) for _ in range(slots)]
    try:
        async with httpx.AsyncClient(timeout=10) as probe:
            await asyncio.sleep(WARM_UP)
            before, start = await _generated(probe, url), loop.time()
            await asyncio.sleep(seconds)
            after, end = await _generated(probe, url), loop.time()
    finally:
        for task in workers:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*workers, return_exceptions=True)
        await client.close()
    for task in workers:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"a capacity request failed: {task.exception()}")
    return (after - before) / (end - start)


def full_load_tokens_per_s(
    url: str, model: str, workload: Workload, *, slots: int, seconds: float, seed: int = 0
) -> float:
    return asyncio.run(_measure(url, model, workload, slots, seconds, seed))
