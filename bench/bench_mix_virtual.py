"""The real-vLLM mix benchmark's shim flags in virtual time, on the engine model fitted to that vLLM.

    .venv/bin/python bench/bench_mix_virtual.py                       # a few seconds
    .venv/bin/python bench/bench_mix_virtual.py --budgets 2500,3500,5000 --seeds 5

The real-vLLM mix (``scoreboard.py --scenarios mix``) on the 2-core machine moves by tens of
percent from run to run with the other jobs beside it; this plays the same question without a
clock: the shim's real admission decisions (``lab/mix_model.py``, built from :data:`COUNT_FLAGS` and a
cost budget) in front of the simulator's engine model with ``scoreboard.FITTED_ENGINE_FLAGS``,
the mix of ``lab/workload.py``'s ``CHAT_AND_LONG`` (80 % chat with a 5 s TTFT budget, 20 %
long prompts, batch) at 2x the model's capacity for 30 s and 8 long prompts at once at 10 s.
Callers make one attempt (no retries): a refused chat is lost, a long prompt refused after
its 30 s queue wait too. Per arm, medians over the seeds: useful tokens, chat within budget,
long prompts served, chat TTFT p99; and the useful tokens of each seed. Run it with another
install's interpreter to compare builds of the shim on the same seeds.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
from collections.abc import Sequence

import scoreboard as real
from llm_backoff_shim.lab.mix_model import MixResult, capacity, mix_arrivals, run_mix
from llm_backoff_shim.lab.workload import CHAT_AND_LONG

#: The request-count cap the cost budgets are set beside: calibrate's chat-only recommendation
#: on the real vLLM of an earlier run (its figures in git history).
COUNT_FLAGS = (
    "--max-concurrency 12 --max-queue 108 --max-queue-wait 0.75 --interactive-max-queue 5 "
    "--batch-max-queue 103 --batch-max-queue-wait 30 --retry-after-max 5"
)

DURATION = 30.0
BURST = (10.0, 8)


def figures(result: MixResult) -> tuple[float, ...]:
    chat = result.by_part.get("chat", [])
    long_ = result.by_part.get("long", [])
    return (
        result.useful_tokens,
        result.count("chat", lambda c: c.useful),
        len(chat),
        result.count("long", lambda c: c.useful),
        len(long_),
        result.ttft_quantile("chat", 0.99),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="2500,3500,5000", help="cost budgets, in tokens")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    engine = real.engine_params(real.FITTED_ENGINE_FLAGS)
    rate = 2 * capacity(engine, CHAT_AND_LONG)
    long_part = CHAT_AND_LONG.part("long")
    print(f"engine model [{real.FITTED_ENGINE_FLAGS}]; the mix at {rate:.2f} calls/s (2x) for {DURATION:g} s")
    arms = {"count cap": shlex.split(COUNT_FLAGS)}
    for budget in args.budgets.split(","):
        arms[f"cost cap {budget}"] = [*shlex.split(COUNT_FLAGS), "--max-inflight-tokens", budget]
    for arm, flags in arms.items():
        rows = []
        for seed in range(1, args.seeds + 1):
            arrivals = mix_arrivals(
                CHAT_AND_LONG, rate, DURATION, random.Random(seed), burst=(*BURST, long_part)
            )
            rows.append(figures(run_mix(arrivals, engine, flags, DURATION)))
        med = [statistics.median(r[i] for r in rows) for i in range(6)]
        print(
            f"{arm:16s} useful {med[0]:6.0f}  chat within budget {med[1]:.0f}/{med[2]:.0f}  long served "
            f"{med[3]:.0f}/{med[4]:.0f}  chat TTFT p99 {med[5]:.2f} s  per seed {[int(r[0]) for r in rows]}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
