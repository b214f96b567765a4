"""Does ``calibrate`` use the engine? Its choice against a reference sweep, on a vLLM-like simulator.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate.py          # ~8 min
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate.py --quick  # ~4 min

The simulator is set to a vLLM-like shape (``SIM_FLAGS``: 8 sequences, steps slowing by 10 %
per extra sequence, prefill per prompt token, natural answers lognormal around 64 tokens).
Then, against the same simulator:

1. ``calibrate`` runs ``--seeds`` times with its defaults (varied lengths) and the SLOs below;
   each run's recommended ``--max-concurrency`` and confidence are kept;
2. optionally (``--before DIR``: a checkout of an earlier version) the earlier calibrate runs
   too, as a subprocess with that checkout first on ``PYTHONPATH``;
3. a reference sweep measures every level of ``REFERENCE_LEVELS`` ``--rounds`` times
   (levels interleaved, so the machine's drift falls on all of them), with calibrate's own
   load generator and lengths: its medians give the in-SLO throughput of each level.

Reported: each choice's reference throughput against the best in-SLO reference level
(the target: no more than 10 % left unused), a table, a PNG and a Markdown section.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai

from llm_backoff_shim.lab import calibrate
from llm_backoff_shim.lab.calibrate_driver import Driver, streaming_http_client
from llm_backoff_shim.lab.calibrate_loop import ClosedLoop, measure_level
from llm_backoff_shim.lab.calibrate_ramp import CalibrateConfig
from llm_backoff_shim.lab.calibrate_samples import summarize
from llm_backoff_shim.lab.knee import KneeRule, StepStats, Verdict, judge_level
from llm_backoff_shim.lab.procs import sim_server

SIM_FLAGS = [
    "--max-num-seqs", "8", "--ttft", "0.02", "--itl", "0.008", "--itl-batch-factor", "0.1",
    "--prefill-time-per-token", "0.0001", "--output-tokens", "64", "--output-tokens-sigma", "0.8",
    "--seed", "1",
]  # fmt: skip
REFERENCE_LEVELS = (1, 2, 4, 6, 8, 10, 12, 16, 24, 32)
TTFT_SLO = 1.0
TPOT_SLO = 0.1


def run_calibrate(url: str, seed: int, step_seconds: float, out: Path) -> dict[str, Any]:
    argv = [
        "--upstream", url, "--ttft-slo", str(TTFT_SLO), "--tpot-slo", str(TPOT_SLO), "--max-level", "64",
        "--step-seconds", str(step_seconds), "--seed", str(seed), "--out", str(out), "--json",
    ]  # fmt: skip
    stdout, stderr = io.StringIO(), io.StringIO()
    status = calibrate.main(argv, stdout=stdout, stderr=stderr)
    result: dict[str, Any] = json.loads(stdout.getvalue()) if stdout.getvalue().strip() else {}
    result["status"] = status
    return result


def run_before(before: Path, url: str, seed: int, step_seconds: float, out: Path) -> dict[str, Any]:
    """The earlier calibrate (its own defaults but lengths varied as much as it can: uniform)."""
    env = {**os.environ, "PYTHONPATH": f"{before / 'server_shim' / 'src'}:{before / 'src'}"}
    argv = [
        sys.executable, "-m", "llm_backoff_shim.cli", "calibrate", "--upstream", url,
        "--ttft-slo", str(TTFT_SLO), "--max-level", "64", "--step-seconds", str(step_seconds),
        "--seed", str(seed), "--prompt-words", "5-200", "--output-tokens", "16-256",
        "--out", str(out), "--json",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, check=False)
    result: dict[str, Any] = json.loads(proc.stdout) if proc.stdout.strip() else {}
    result["status"] = proc.returncode
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


def in_slo_throughput(verdicts: dict[int, Verdict], level: int) -> float:
    """The reference throughput at ``level`` (the nearest reference level at or below it)."""
    known = max((c for c in verdicts if c <= level), default=min(verdicts))
    return verdicts[known].throughput


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter steps and fewer runs")
    p.add_argument("--seeds", type=int, default=3, help="calibrate runs (seeds 0..N-1)")
    p.add_argument("--rounds", type=int, default=3, help="measurements of each reference level")
    p.add_argument("--before", type=Path, default=None, help="a checkout of an earlier version to compare")
    p.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for the PNG and JSON")
    args = p.parse_args(argv)
    step = 3.0 if args.quick else 5.0
    seeds = min(args.seeds, 2) if args.quick else args.seeds
    rounds = min(args.rounds, 2) if args.quick else args.rounds
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rule = KneeRule(ttft_slo=TTFT_SLO, tpot_slo=TPOT_SLO)
    with sim_server(SIM_FLAGS) as sim:
        print(
            f"simulator: {' '.join(SIM_FLAGS)}; SLO p99 TTFT {TTFT_SLO:g} s, p99 TPOT {TPOT_SLO:g} s",
            flush=True,
        )
        choices: list[dict[str, Any]] = []
        for seed in range(seeds):
            print(f"calibrate, seed {seed}...", flush=True)
            result = run_calibrate(sim.url, seed, step, args.out / f"calibrate-seed{seed}")
            rec = result.get("recommendation") or {}
            choices.append(
                {
                    "who": "calibrate",
                    "seed": seed,
                    "level": rec.get("max_concurrency"),
                    "confidence": result.get("confidence"),
                    "measurements": len(result.get("steps", [])),
                    "command": rec.get("command"),
                }
            )
            print(f"  -> {choices[-1]}", flush=True)
        if args.before is not None:
            for seed in range(seeds):
                print(f"earlier calibrate ({args.before}), seed {seed}...", flush=True)
                result = run_before(
                    args.before, sim.url, seed, step, args.out / f"calibrate-before-seed{seed}"
                )
                rec = result.get("recommendation") or {}
                choices.append(
                    {
                        "who": "earlier calibrate",
                        "seed": seed,
                        "level": rec.get("max_concurrency"),
                        "confidence": None,
                        "measurements": len(result.get("steps", [])),
                        "command": rec.get("command"),
                    }
                )
                print(f"  -> {choices[-1]}", flush=True)
        print(f"reference sweep: levels {REFERENCE_LEVELS}, {rounds} rounds of {step:g} s", flush=True)
        runs = asyncio.run(reference_sweep(sim.url, rounds, step))
    verdicts = {level: judge_level(level, steps, rule) for level, steps in runs.items()}
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
        "| run | seed | recommended --max-concurrency | confidence | measurements "
        "| reference tok/s there | of the best in-SLO |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for c in choices:
        level = c["level"]
        there = in_slo_throughput(verdicts, level) if level else 0.0
        ok = level is not None and verdicts[max(x for x in verdicts if x <= level)].good
        share = there / best if best and ok else 0.0
        c["reference_throughput"] = there
        c["share_of_best"] = share
        lines.append(
            f"| {c['who']} | {c['seed']} | {level} | {c['confidence'] or '-'} | {c['measurements']} | "
            f"{there:.0f} | {share:.0%}{'' if ok else ' (over the SLO)'} |"
        )
    summary = f"best in-SLO reference level: {best_level} at {best:.0f} tok/s"
    text = "\n".join(lines)
    print("\n" + text + "\n\n" + summary)
    _plot(verdicts, choices, args.out / "calibrate-bench.png")
    (args.out / "calibrate-bench.json").write_text(
        json.dumps(
            {
                "sim_flags": SIM_FLAGS,
                "reference": {
                    str(k): {
                        "tok_s": v.throughput,
                        "ttft_p99": v.ttft_p99,
                        "tpot_p99": v.tpot_p99,
                        "good": v.good,
                    }
                    for k, v in verdicts.items()
                },
                "choices": choices,
                "best_level": best_level,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"plot: {args.out / 'calibrate-bench.png'}; total {time.monotonic() - started:.0f} s")
    return 0


def _plot(verdicts: dict[int, Verdict], choices: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    xs = list(verdicts)
    ax.plot(xs, [verdicts[x].throughput for x in xs], "o-", color="tab:blue", label="reference (median)")
    for x in xs:
        if not verdicts[x].good:
            ax.plot([x], [verdicts[x].throughput], "x", color="tab:red", markersize=10)
    colours = {"calibrate": "tab:green", "earlier calibrate": "tab:orange"}
    for c in choices:
        if c["level"]:
            ax.axvline(c["level"], color=colours[c["who"]], linestyle="--", alpha=0.6)
    ax.plot([], [], "x", color="tab:red", label="over the SLO")
    for who, colour in colours.items():
        ax.plot([], [], "--", color=colour, label=f"{who}'s choices")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrency (closed-loop workers)")
    ax.set_ylabel("answer tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.suptitle(f"calibrate's choice vs the in-SLO throughput (TTFT p99 <= {TTFT_SLO:g} s, TPOT p99 <= "
                 f"{TPOT_SLO * 1000:g} ms)")  # fmt: skip
    fig.savefig(path, format="png")


if __name__ == "__main__":
    sys.exit(main())
