"""A burst of long prompts on top of steady chat, on real processes: the simulator (KV cache and
prefill cost set) behind a shim with the request cap sized for chat, and behind one with the
cost budget; a load generator of streaming httpx calls. The wall-clock check of
bench_cost_budget.py's 'burst' scenario, scaled to two cores.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_cost_budget_wire.py

Chat (interactive) is sent open-loop at --chat-rate for --seconds, streaming, with
``x-request-timeout-ms: 5000`` and ``x-request-timeout-scope: start`` (the SDK's start
deadline), and hangs up when its first token is 5 s late; --burst long prompts (batch, the
mix's 1,150-2,300 words) arrive at once --burst-at seconds in. Figures per arm: chat calls
within the 5 s TTFT budget, chat TTFT p99 of those the shim admitted (a caller that hung up
counts as infinite), chat refused by the shim, long prompts served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from llm_backoff_shim.lab.procs import shim_server, sim_server, start_stack
from llm_backoff_shim.lab.workload import CHAT_AND_LONG, MixPart

SIM = [
    "--max-num-seqs", "32", "--ttft", "0.05", "--itl", "0.03", "--itl-batch-factor", "0.02",
    "--prefill-time-per-token", "0.0002", "--max-num-batched-tokens", "2048",
    "--kv-cache-tokens", "16384", "--seed", "1",
]  # fmt: skip
SHIM = ["--classes", "interactive,batch", "--max-queue", "200", "--class-max-queue-wait",
        "interactive=5,batch=60", "--access-log", "false"]  # fmt: skip
ARMS = {
    "cap 32 (sized for chat)": [*SHIM, "--max-concurrency", "32"],
    "budget 8000": [*SHIM, "--max-concurrency", "32", "--max-inflight-tokens", "8000"],
}


@dataclass
class Call:
    part: str
    at: float
    status: int = 0
    ttft: float | None = None
    gave_up: bool = False
    done: bool = False


async def one(
    client: httpx.AsyncClient, url: str, part: MixPart, text: str, max_tokens: int, call: Call
) -> None:
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": text}],
    }
    headers = {"x-request-class": part.cls}
    if part.ttft_budget is not None:
        headers["x-request-timeout-ms"] = str(int(part.ttft_budget * 1000))
        headers["x-request-timeout-scope"] = "start"
    start = time.monotonic()

    async def stream() -> None:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as answer:
            call.status = answer.status_code
            if answer.status_code != 200:
                await answer.aread()
                return
            async for line in answer.aiter_lines():
                if call.ttft is None and line.startswith("data: {") and '"content"' in line:
                    call.ttft = time.monotonic() - start
                    first.set()
            call.done = True

    first = asyncio.Event()
    task = asyncio.create_task(stream())
    if part.ttft_budget is None:
        await task
        return
    waiter = asyncio.create_task(first.wait())
    await asyncio.wait({waiter, task}, timeout=part.ttft_budget, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not first.is_set() and not task.done():
        call.gave_up = True  # no first token within the budget: hang up
        task.cancel()
    await asyncio.gather(task, waiter, return_exceptions=True)


async def load(url: str, rate: float, seconds: float, burst: int, burst_at: float, seed: int) -> list[Call]:
    rng = random.Random(seed)
    chat, long_ = CHAT_AND_LONG.part("chat"), CHAT_AND_LONG.part("long")
    plan: list[tuple[float, MixPart]] = []
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            break
        plan.append((at, chat))
    plan += [(burst_at, long_)] * burst
    plan.sort(key=lambda p: p[0])
    calls: list[Call] = []
    tasks = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), limits=limits) as client:
        began = time.monotonic()
        for offset, part in plan:
            text, max_tokens = part.workload.draw(rng)
            delay = began + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            call = Call(part.name, offset)
            calls.append(call)
            tasks.append(asyncio.create_task(one(client, url, part, text, max_tokens, call)))
        await asyncio.gather(*tasks, return_exceptions=True)
    return calls


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else math.nan


def summary(calls: list[Call]) -> dict[str, object]:
    chats = [c for c in calls if c.part == "chat"]
    longs = [c for c in calls if c.part == "long"]
    sent = [c for c in chats if c.status == 200 or c.gave_up]
    return {
        "chat": len(chats),
        "chat_ok": sum(1 for c in chats if c.done and c.ttft is not None and c.ttft <= 5.0),
        "chat_ttft_p99": p99([math.inf if c.ttft is None else c.ttft for c in sent]),
        "chat_refused": sum(1 for c in chats if c.status not in (0, 200)),
        "chat_gave_up": sum(1 for c in chats if c.gave_up),
        "long": len(longs),
        "long_ok": sum(1 for c in longs if c.done),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chat-rate", type=float, default=6.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--burst-at", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"simulator: {' '.join(SIM)}")
    print(
        f"chat {args.chat_rate:g}/s for {args.seconds:g} s; {args.burst} long prompts at {args.burst_at:g} s",
        flush=True,
    )
    for name, flags in ARMS.items():
        sim = sim_server(SIM)
        shim = shim_server(sim, flags)
        start_stack(sim, [shim])
        try:
            run = load(shim.url, args.chat_rate, args.seconds, args.burst, args.burst_at, args.seed)
            calls = asyncio.run(run)
        finally:
            shim.close()
            sim.close()
        print(f"{name:24s} {json.dumps(summary(calls))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
