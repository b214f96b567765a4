"""Which interactive queue wait (and queue) serves most chat within its TTFT budget, in virtual time.

Calibrate recommends the interactive class's ``--max-queue-wait`` W and ``--interactive-max-queue``
``floor(rate x W)``. This plays :mod:`oracle_bound`'s trace (the virtual-time model of the
real-vLLM comparison: 8 slots, 50 ms TTFT, 8 ms per token, answers lognormal median 64, 70 %
interactive with a 5 s TTFT budget, 20 s deadline) through the shim's real controller for each W,
with batch held as calibrate recommends (15 s, ``floor(rate x 15)``, ``--retry-after-max 5``), for
plain-openai-like callers (no budget sent, 2 retries, every hint honoured) and the SDK's presets
(``RetryPolicy.interactive()`` / ``RetryPolicy.batch``), and prints interactive calls whose first
token came within the budget (medians over seeds), beside the interactive-first oracle's.

    cd bench && ../.venv/bin/python bench_interactive_queue.py --seeds 5 --rate-factor 2.5
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence

from llm_backoff_shim.lab.overload_model import OutputLengths, OverloadModel
from llm_backoff_shim.lab.scenario import EngineShape, Scenario
from oracle_bound import (
    PLAIN,
    POLICIES,
    model_jobs,
    plain_controller,
    plain_policy,
    policy_in_model,
    schedule,
)


def flags_for(wait: float, rate: float, slots: int, queue: int | None = None) -> list[str]:
    interactive = queue if queue is not None else max(1, math.floor(rate * wait + 1e-9))
    held = max(1, math.floor(rate * 15 + 1e-9))
    return (
        f"--max-concurrency {slots} --max-queue {interactive + held} --max-queue-wait {wait:g} "
        f"--interactive-max-queue {interactive} --batch-max-queue {held} --batch-max-queue-wait 15 "
        "--retry-after-max 5"
    ).split()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--rate-factor", type=float, default=2.5)
    p.add_argument("--service-jitter", type=float, default=0.3)
    p.add_argument("--waits", default="0.18,0.5,0.9,1.5,2,3,4,4.5,4.9")
    p.add_argument("--queues", default="", help="fixed interactive queues instead of floor(rate x wait)")
    args = p.parse_args(argv)
    shape = EngineShape(slots=8, ttft=0.05, itl=0.008, output_tokens=64)
    lengths = OutputLengths(64, 0.8, 512)
    scenario = Scenario(
        "real-vllm-like",
        burst=0,
        rate_factor=args.rate_factor,
        duration=args.duration,
        deadline=20,
        ttft_budget=5,
        interactive_share=0.7,
        start_deadline=True,
    )
    probe = OverloadModel(scenario, shape, ["--max-concurrency", "8"], seed=1, lengths=lengths)
    rate = probe.capacity  # completions/s with every slot busy: calibrate's req/s at the knee
    oracle = []
    for seed in range(1, args.seeds + 1):
        jobs = model_jobs(scenario, shape, lengths, seed, args.service_jitter)
        served = schedule(jobs, shape.slots, classes_first=("interactive",)).served_by_class
        oracle.append(served.get("interactive", 0))
    print(
        f"engine: {rate:.2f} req/s with 8 slots busy; arrivals {args.rate_factor:g}x for "
        f"{args.duration:g} s; interactive-first oracle {statistics.median(oracle):.0f} interactive "
        f"within 5 s (median of {args.seeds})"
    )
    print(
        "| wait | interactive queue | plain-like in budget | presets in budget | plain batch | "
        "presets batch |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    cases = [(float(w), None) for w in args.waits.split(",")]
    if args.queues:
        cases = [(float(w), int(q)) for w in args.waits.split(",") for q in args.queues.split(",")]
    for wait, queue in cases:
        flags = flags_for(wait, rate, shape.slots, queue)
        row: dict[str, tuple[float, float]] = {}
        for name, policy in ((PLAIN, plain_policy), ("presets", POLICIES["presets"])):
            inb, batch = [], []
            for seed in range(1, args.seeds + 1):
                played = OverloadModel(
                    scenario,
                    shape,
                    flags,
                    seed=seed,
                    service_jitter=args.service_jitter,
                    lengths=lengths,
                    controller=plain_controller(flags) if name == PLAIN else None,
                )
                with policy_in_model(policy):
                    result = played.run()
                inb.append(sum(played.useful(c) for c in result.calls if c.arrival.cls == "interactive"))
                calls = [c for c in result.calls if c.arrival.cls == "batch"]
                batch.append(sum(c.ok for c in calls) / max(1, len(calls)))
            row[name] = (statistics.median(inb), statistics.median(batch))
        q = flags[flags.index("--interactive-max-queue") + 1]
        print(
            f"| {wait:g} s | {q} | {row[PLAIN][0]:.0f} | {row['presets'][0]:.0f} | "
            f"{row[PLAIN][1]:.0%} | {row['presets'][1]:.0%} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
