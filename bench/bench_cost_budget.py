"""The request cap against the cost budget, chat beside long prompts, in virtual time
(llm_backoff_shim.lab.mix_model): the shim's real admission decisions before the simulator's
engine model (continuous batching, 0.1 ms of prefill per prompt token, a KV cache of 65,536
tokens, 128 sequences), callers that hang up when their first token is late. No sockets, no
sleeping: a run takes a fraction of a second, a seed gives the same run every time.

    .venv/bin/python bench/bench_cost_budget.py --seeds 3

Scenarios (lab/workload.py's CHAT_AND_LONG: 80 % chat, interactive, 5 s TTFT budget; 20 % long
prompts of 1.5-3k tokens, batch):

- ``mix-2x``: the mix offered at twice the engine's capacity for it, for 60 s;
- ``burst``: chat alone at 0.6 of the engine's chat capacity for 40 s, and 60 long prompts at 10 s;
- ``chat-1.5x``: chat alone at 1.5 times the engine's chat capacity for 40 s.

Arms: the engine alone (``direct``), the request cap sized for chat (128, the engine's
sequences) and for long prompts (24: the KV cache holds about 24 of them), and the cost budget
(``--max-inflight-tokens``, two sizes, with the cap at 128). Each shim arm serves interactive
first, with queue waits of 5 s (interactive) and 60 s (batch). Figures: chat calls within their
TTFT budget, chat TTFT p99 (of the calls the engine was sent; a caller that hung up counts as
infinite), long prompts served, useful tokens (output of calls served within their budget),
the engine's output tokens per second, and engine preemptions; medians over the seeds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from llm_backoff_shim.lab.mix_model import MixArrival, MixResult, capacity, mix_arrivals, run_mix
from llm_backoff_shim.lab.workload import CHAT_AND_LONG, Mix, MixPart
from llm_backoff_shim.sim.engine import EngineParams

ENGINE = EngineParams(
    max_num_seqs=128,
    ttft=0.05,
    itl=0.02,
    itl_batch_factor=0.01,
    prefill_time_per_token=0.0001,
    max_num_batched_tokens=2048,
    kv_cache_tokens=65536,
)
CHAT = CHAT_AND_LONG.part("chat")
LONG = CHAT_AND_LONG.part("long")
CHAT_ONLY = Mix((MixPart("chat", 1.0, CHAT.workload, CHAT.cls, CHAT.ttft_budget),))

SHIM = ["--classes", "interactive,batch", "--max-queue", "400"]
SHIM += ["--class-max-queue-wait", "interactive=5,batch=60"]


def arms(budgets: Sequence[int]) -> dict[str, list[str] | None]:
    found: dict[str, list[str] | None] = {
        "direct": None,
        "cap 128": [*SHIM, "--max-concurrency", "128"],
        "cap 24": [*SHIM, "--max-concurrency", "24"],
    }
    for tokens in budgets:
        found[f"budget {tokens}"] = [*SHIM, "--max-concurrency", "128", "--max-inflight-tokens", str(tokens)]
    return found


def row(result: MixResult) -> dict[str, float]:
    chat, long_ = result.by_part.get("chat", []), result.by_part.get("long", [])
    return {
        "chat ok": result.count("chat", lambda c: c.useful),
        "chat n": len(chat),
        "chat p99": result.ttft_quantile("chat", 0.99),
        "long ok": result.count("long", lambda c: c.useful),
        "long n": len(long_),
        "useful": result.useful_tokens,
        "tok/s": result.token_rate,
        "preempt": result.preemptions,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budgets", default="32000,65536", help="cost budgets to compare, in tokens")
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    started = time.monotonic()
    mix_capacity = capacity(ENGINE, CHAT_AND_LONG)
    chat_capacity = capacity(ENGINE, CHAT_ONLY)
    print(f"engine: {ENGINE}")
    print(f"mix: {CHAT_AND_LONG.describe()}")
    print(f"capacity: {mix_capacity:.2f} calls/s of the mix, {chat_capacity:.1f} calls/s of chat alone")
    scenarios: dict[str, Callable[[random.Random], tuple[list[MixArrival], float]]] = {
        "mix-2x": lambda rng: (mix_arrivals(CHAT_AND_LONG, 2 * mix_capacity, 60, rng), 60.0),
        "burst": lambda rng: (
            mix_arrivals(CHAT_ONLY, 0.6 * chat_capacity, 40, rng, burst=(10.0, 60, LONG)),
            40.0,
        ),
        "chat-1.5x": lambda rng: (mix_arrivals(CHAT_ONLY, 1.5 * chat_capacity, 40, rng), 40.0),
    }
    header = (
        f"{'scenario':10s} {'arm':13s} {'chat ok':>11s} {'chat p99':>8s} {'long ok':>9s} "
        f"{'useful':>7s} {'tok/s':>6s} {'preempt':>7s}"
    )
    print(header)
    for name, make in scenarios.items():
        runs: dict[str, list[dict[str, float]]] = {}
        for seed in range(1, args.seeds + 1):
            arrivals, duration = make(random.Random(seed))
            for arm, flags in arms(budgets).items():
                runs.setdefault(arm, []).append(row(run_mix(arrivals, ENGINE, flags, duration)))
        for arm, rows in runs.items():
            med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            p99 = med["chat p99"]
            shown = "inf" if p99 == float("inf") else f"{p99:.2f}"
            long_ok = f"{med['long ok']:.0f}/{med['long n']:.0f}" if med["long n"] else "-"
            print(
                f"{name:10s} {arm:13s} {med['chat ok']:5.0f}/{med['chat n']:<5.0f} {shown:>8s} {long_ok:>9s} "
                f"{med['useful']:7.0f} {med['tok/s']:6.0f} {med['preempt']:7.0f}",
                flush=True,
            )
    print(f"({args.seeds} seeds, {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
