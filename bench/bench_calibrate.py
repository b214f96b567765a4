"""Does ``calibrate`` pick the right concurrency? Its choice against a reference sweep.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate.py --out /tmp/calbench  # ~8 min
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate.py --quick               # ~4 min

On the simulator as a fast engine (``FAST_ENGINE``, answers lognormal around 64 tokens),
calibrate runs ``--seeds`` times with the SLOs below; then every level of ``REFERENCE_LEVELS`` is
measured ``--rounds`` times (levels interleaved) with calibrate's own load generator. Reported:
each choice's reference throughput against the best in-SLO level (target: at most 10 % left
unused), the tables, and a JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai

from llm_backoff_shim.lab import calibrate
from llm_backoff_shim.lab.calibrate.measure import KneeRule, StepStats, judge_level, summarize
from llm_backoff_shim.lab.calibrate.run import (
    CalibrateConfig,
    ClosedLoop,
    Driver,
    measure_level,
    streaming_http_client,
)
from llm_backoff_shim.lab.procs import sim_server

FAST_ENGINE = [
    "--max-num-seqs", "8", "--ttft", "0.02", "--itl", "0.008", "--itl-batch-factor", "0.1",
    "--prefill-time-per-token", "0.0001", "--seed", "1",
]  # fmt: skip
REFERENCE_LEVELS = (1, 2, 4, 6, 8, 10, 12, 16, 24, 32)
TTFT_SLO = 1.0
TPOT_SLO = 0.1
SLO_FLAGS = ["--ttft-slo", str(TTFT_SLO), "--tpot-slo", str(TPOT_SLO)]


def run_calibrate(url: str, flags: list[str], seed: int, out: Path) -> dict[str, Any]:
    """One in-process calibrate run: its JSON result, plus its exit status and wall time."""
    stdout, stderr = io.StringIO(), io.StringIO()
    began = time.monotonic()
    argv = ["--upstream", url, *flags, "--seed", str(seed), "--out", str(out), "--json"]
    status = calibrate.main(argv, stdout=stdout, stderr=stderr)
    print(stderr.getvalue(), end="", flush=True)
    result: dict[str, Any] = json.loads(stdout.getvalue()) if stdout.getvalue().strip() else {}
    result["status"], result["seconds"] = status, time.monotonic() - began
    return result


async def reference_sweep(url: str, rounds: int, step_seconds: float) -> dict[int, list[StepStats]]:
    config = CalibrateConfig(
        upstream=url, ttft_slo=TTFT_SLO, levels=REFERENCE_LEVELS, step_seconds=step_seconds
    )
    # Every reference measurement counts twice calibrate's completions over at least step_seconds.
    sizing = replace(config.sizing, per_slot=4, minimum=40, max_durations=12)
    client = openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key="EMPTY",
        max_retries=0,
        timeout=300,
        http_client=streaming_http_client(max(REFERENCE_LEVELS)),
    )
    runs: dict[int, list[StepStats]] = {level: [] for level in REFERENCE_LEVELS}
    async with client:
        driver = Driver(client, "sim-model", config, time.monotonic, random.Random(99))
        loop = ClosedLoop(driver.one_request, time.monotonic)
        try:
            for r in range(rounds):
                for level in REFERENCE_LEVELS:
                    m = await measure_level(loop, level, sizing, time.monotonic() + 600)
                    step = summarize(level, m.samples, level_start=m.level_start, window=m.window)
                    runs[level].append(step)
                    print(
                        f"  reference round {r + 1}/{rounds} concurrency {level:>3}: "
                        f"{step.output_tokens_per_s:6.0f} tok/s, TTFT p99 {step.ttft_p99:.3f} s, "
                        f"TPOT p99 {step.itl_p99 * 1000:.1f} ms",
                        flush=True,
                    )
        finally:
            await loop.close()
    return runs


def run_reference(args: argparse.Namespace) -> None:
    step = 3.0 if args.quick else 5.0
    seeds = min(args.seeds, 2) if args.quick else args.seeds
    rounds = min(args.rounds, 2) if args.quick else args.rounds
    sim_flags = [*FAST_ENGINE, "--output-tokens", "64", "--output-tokens-sigma", "0.8"]
    flags = [*SLO_FLAGS, "--max-level", "64", "--step-seconds", str(step)]
    with sim_server(sim_flags) as sim:
        print(f"simulator: {' '.join(sim_flags)}; SLO p99 TTFT {TTFT_SLO:g} s, p99 TPOT {TPOT_SLO:g} s")
        choices: list[dict[str, Any]] = []
        for seed in range(seeds):
            print(f"calibrate, seed {seed}...", flush=True)
            result = run_calibrate(sim.url, flags, seed, args.out / f"calibrate-seed{seed}")
            rec = result.get("recommendation") or {}
            choices.append(
                {
                    "seed": seed,
                    "level": rec.get("max_concurrency"),
                    "confidence": result.get("confidence"),
                    "measurements": len(result.get("steps", [])),
                    "command": rec.get("command"),
                }
            )
            print(f"  -> {choices[-1]}", flush=True)
        print(f"reference sweep: levels {REFERENCE_LEVELS}, {rounds} rounds of {step:g} s", flush=True)
        runs = asyncio.run(reference_sweep(sim.url, rounds, step))
    verdicts = {
        level: judge_level(level, steps, KneeRule(TTFT_SLO, TPOT_SLO)) for level, steps in runs.items()
    }
    good = {level: v for level, v in verdicts.items() if v.good}
    best_level = max(good, key=lambda c: good[c].throughput)
    best = good[best_level].throughput
    lines = [
        "| concurrency | answer tok/s (median) | TTFT p99 | TPOT p99 | within SLO |",
        "|---:|---:|---:|---:|---|",
    ]
    for level, v in verdicts.items():
        lines.append(
            f"| {level} | {v.throughput:.0f} | {v.ttft_p99:.3f} s | {v.tpot_p99 * 1000:.1f} ms | "
            f"{'yes' if v.good else 'no'} |"
        )
    lines += [
        "",
        "| seed | recommended --max-concurrency | confidence | measurements | reference tok/s there "
        "| of the best in-SLO |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for c in choices:
        level = c["level"]
        # The reference at the nearest reference level at or below the choice.
        known = max((x for x in verdicts if x <= level), default=min(verdicts)) if level else None
        there = verdicts[known].throughput if known is not None else 0.0
        ok = known is not None and verdicts[known].good
        c["reference_throughput"], c["share_of_best"] = there, there / best if best and ok else 0.0
        lines.append(
            f"| {c['seed']} | {level} | {c['confidence'] or '-'} | {c['measurements']} | "
            f"{there:.0f} | {c['share_of_best']:.0%}{'' if ok else ' (over the SLO)'} |"
        )
    print("\n" + "\n".join(lines) + f"\n\nbest in-SLO reference level: {best_level} at {best:.0f} tok/s")
    reference = {
        str(k): {"tok_s": v.throughput, "ttft_p99": v.ttft_p99, "tpot_p99": v.tpot_p99, "good": v.good}
        for k, v in verdicts.items()
    }
    record = {"sim_flags": sim_flags, "reference": reference, "choices": choices, "best_level": best_level}
    (args.out / "calibrate-bench.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"JSON: {args.out / 'calibrate-bench.json'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for the results")
    p.add_argument("--quick", action="store_true", help="shorter steps and fewer runs")
    p.add_argument("--seeds", type=int, default=3, help="calibrate runs (seeds 0..N-1)")
    p.add_argument("--rounds", type=int, default=3, help="measurements of each reference level")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    run_reference(args)
    print(f"(took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
