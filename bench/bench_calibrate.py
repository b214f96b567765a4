"""Is ``calibrate``'s recommendation right, stable, and does its cost budget leave an idle engine alone?

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate.py          # ~8 min
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate.py --quick  # ~4 min
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate.py --mode twice --engine slow
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate.py --mode cost-idle

Every mode starts the simulator set up as an engine: ``fast`` (8 sequences, 8 ms per token
alone, steps 10 % slower per extra sequence, prefill per prompt token, natural answers
lognormal around 64 tokens; a request takes about a second) or ``slow`` (the GPU box of a slow
engine at ``--scale`` of its time scale: 16 sequences, 14.9 % slower per extra sequence, answers
of median 128 tokens, 20 % of the prompts 1500-3000 words long; at 0.5 about 6.5 s a request).

``--mode reference`` (the fast engine): calibrate runs ``--seeds`` times with its defaults and
the SLOs below; then a reference sweep measures every level of ``REFERENCE_LEVELS`` ``--rounds``
times (levels interleaved, so the machine's drift falls on all of them) with calibrate's own
load generator and lengths. Reported: each choice's reference throughput against the best
in-SLO level (the target: no more than 10 % left unused), a table, a PNG and a JSON in ``--out``.

``--mode twice``: two calibrate runs on the same ``--engine`` with different seeds (so they draw
different requests), sharing one ``--out`` folder (its runs' file emptied first) so the second
run's confidence is earned against the first, as calibrate's is across runs. Prints each run's
``--max-concurrency``, ``--max-inflight-tokens``, confidence, measurements and time, and the
larger relative difference of the two (the target: within 15 %).

``--mode cost-idle`` (the fast engine, every natural answer 64 tokens): calibrate on the chat and
long-prompt mix, then a shim with exactly the flags it printed (or ``--flags``) and, on the idle
engine, through the shim with the openai client (no retries), one call alone and then 8 at
once, with ``max_tokens: 4096`` and with none: how many of the 8 were refused (429) and how long
they took against the one alone, beside the same calls straight to the engine (8 together take
about 1.6 times one). A cost budget that refuses work the idle engine could do shows as 429s.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai

from llm_backoff_shim.lab import calibrate
from llm_backoff_shim.lab.calibrate.measure import KneeRule, StepStats, Verdict, judge_level, summarize
from llm_backoff_shim.lab.calibrate.report import HISTORY_NAME
from llm_backoff_shim.lab.calibrate.run import (
    CalibrateConfig,
    ClosedLoop,
    Driver,
    measure_level,
    streaming_http_client,
)
from llm_backoff_shim.lab.procs import shim_server, sim_server

FAST_ENGINE = [
    "--max-num-seqs", "8", "--ttft", "0.02", "--itl", "0.008", "--itl-batch-factor", "0.1",
    "--prefill-time-per-token", "0.0001", "--seed", "1",
]  # fmt: skip
REFERENCE_LEVELS = (1, 2, 4, 6, 8, 10, 12, 16, 24, 32)
TTFT_SLO = 1.0
TPOT_SLO = 0.1
SLO_FLAGS = ["--ttft-slo", str(TTFT_SLO), "--tpot-slo", str(TPOT_SLO)]


def engine(name: str, scale: float) -> tuple[list[str], list[str]]:
    """(simulator flags, calibrate flags) of an engine."""
    if name == "fast":
        return FAST_ENGINE, [*SLO_FLAGS, "--max-level", "64"]
    sim = ["--max-num-seqs", "16", "--ttft", f"{0.1 * scale:g}", "--itl", f"{0.030 * scale:g}",
           "--itl-batch-factor", "0.149", "--prefill-time-per-token", f"{0.0002 * scale:g}",
           "--max-num-batched-tokens", "2048", "--seed", "1"]  # fmt: skip
    flags = ["--ttft-slo", f"{4 * scale:g}", "--tpot-slo", f"{0.2 * scale:g}", "--max-level", "64",
             "--output-tokens", "lognormal:128:0.6:16-512", "--long-share", "0.2",
             "--long-prompt-words", "1500-3000", "--max-seconds", "1800"]  # fmt: skip
    return sim, flags


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


# -- --mode reference ---------------------------------------------------------------------------


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
        there = in_slo_throughput(verdicts, level) if level else 0.0
        ok = level is not None and verdicts[max(x for x in verdicts if x <= level)].good
        c["reference_throughput"], c["share_of_best"] = there, there / best if best and ok else 0.0
        lines.append(
            f"| {c['seed']} | {level} | {c['confidence'] or '-'} | {c['measurements']} | "
            f"{there:.0f} | {c['share_of_best']:.0%}{'' if ok else ' (over the SLO)'} |"
        )
    print("\n" + "\n".join(lines) + f"\n\nbest in-SLO reference level: {best_level} at {best:.0f} tok/s")
    _plot(verdicts, choices, args.out / "calibrate-bench.png")
    reference = {
        str(k): {"tok_s": v.throughput, "ttft_p99": v.ttft_p99, "tpot_p99": v.tpot_p99, "good": v.good}
        for k, v in verdicts.items()
    }
    record = {"sim_flags": sim_flags, "reference": reference, "choices": choices, "best_level": best_level}
    (args.out / "calibrate-bench.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"plot: {args.out / 'calibrate-bench.png'}")


def _plot(verdicts: dict[int, Verdict], choices: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    xs = list(verdicts)
    ax.plot(xs, [verdicts[x].throughput for x in xs], "o-", color="tab:blue", label="reference (median)")
    for x in xs:
        if not verdicts[x].good:
            ax.plot([x], [verdicts[x].throughput], "x", color="tab:red", markersize=10)
    for c in choices:
        if c["level"]:
            ax.axvline(c["level"], color="tab:green", linestyle="--", alpha=0.6)
    ax.plot([], [], "x", color="tab:red", label="over the SLO")
    ax.plot([], [], "--", color="tab:green", label="calibrate's choices")
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


# -- --mode twice -------------------------------------------------------------------------------


def apart(a: float | None, b: float | None) -> float | None:
    """|a - b| over their mean."""
    if a is None or b is None or a + b == 0:
        return None
    return abs(a - b) / ((a + b) / 2)


def run_twice(args: argparse.Namespace) -> None:
    sim_flags, flags = engine(args.engine, args.scale)
    shared = args.out / args.engine
    shared.mkdir(parents=True, exist_ok=True)
    (shared / HISTORY_NAME).unlink(missing_ok=True)  # these two runs, not an earlier bench's
    runs = []
    with sim_server(sim_flags) as sim:
        print(f"simulator: {' '.join(sim_flags)}\ncalibrate: {' '.join(flags)}", flush=True)
        for seed in (int(x) for x in args.twice_seeds.split(",")):
            print(f"--- calibrate, seed {seed}", flush=True)
            result = run_calibrate(sim.url, flags, seed, shared)
            runs.append({**(result.get("recommendation") or {}), **result, "seed": seed})
    print(
        "\n| seed | --max-concurrency | --max-inflight-tokens | confidence (within the run) "
        "| measurements | took |"
    )
    print("|---:|---:|---:|---|---:|---:|")
    for r in runs:
        print(
            f"| {r['seed']} | {r.get('max_concurrency')} | {r.get('max_inflight_tokens')} | "
            f"{r.get('confidence')} ({r.get('confidence_within_run')}) | {len(r.get('steps', []))} | "
            f"{r['seconds']:.0f} s |"
        )
    if len(runs) == 2:
        a, b = runs
        conc = apart(a.get("max_concurrency"), b.get("max_concurrency"))
        cost = apart(a.get("max_inflight_tokens"), b.get("max_inflight_tokens"))
        print(
            f"\napart: --max-concurrency {'-' if conc is None else f'{conc:.0%}'}, "
            f"--max-inflight-tokens {'-' if cost is None else f'{cost:.0%}'} (target: within 15 %)"
        )
    (args.out / f"{args.engine}.json").write_text(
        json.dumps({"sim_flags": sim_flags, "flags": flags, "runs": runs}, indent=1, default=str) + "\n"
    )


# -- --mode cost-idle ---------------------------------------------------------------------------


async def one_then_eight(url: str, max_tokens: int | None) -> tuple[float, float, int]:
    """(seconds for one call alone, seconds for 8 at once, how many of the 8 got a 429)."""
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:

        async def one() -> bool:
            try:
                messages = [{"role": "user", "content": "Say hello to the team."}]
                await client.chat.completions.create(model="sim-model", messages=messages, **extra)  # type: ignore[arg-type]
            except openai.RateLimitError:
                return False
            return True

        start = time.perf_counter()
        await one()
        alone, start = time.perf_counter() - start, time.perf_counter()
        served = await asyncio.gather(*(one() for _ in range(8)))
        return alone, time.perf_counter() - start, served.count(False)


def run_cost_idle(args: argparse.Namespace) -> None:
    sim_flags = [*FAST_ENGINE, "--output-tokens", "64", "--output-tokens-sigma", "0"]
    mix = [*SLO_FLAGS, "--max-level", "32", "--long-share", "0.2", "--long-prompt-words", "1100-2200"]
    with sim_server(sim_flags) as sim:
        if args.flags:
            flags = shlex.split(args.flags)
        else:
            result = run_calibrate(sim.url, [*mix, "--max-seconds", "120"], 0, args.out / "cost-idle")
            words = shlex.split(result["recommendation"]["command"])[2:]
            i = words.index("--upstream")
            flags = words[:i] + words[i + 2 :]
        print("serve flags:", " ".join(flags))
        cases = (("max_tokens 4096", 4096), ("no max_tokens", None))
        with shim_server(sim, [*flags, "--access-log", "false"]) as shim:
            through = [asyncio.run(one_then_eight(shim.url, m)) for _, m in cases]
        direct = [asyncio.run(one_then_eight(sim.url, m)) for _, m in cases]
    print(f"{'calls':<16} {'one alone':>10} {'8 at once':>10} {'ratio':>6} {'429s':>5}  engine alone: ratio")
    for (label, _), (alone, together, refused), (one, eight, _) in zip(cases, through, direct, strict=True):
        print(
            f"{label:<16} {alone:>9.2f}s {together:>9.2f}s {together / alone:>6.2f} {refused:>5}/8"
            f"  {eight / one:>6.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("reference", "twice", "cost-idle"), default="reference")
    p.add_argument("--out", type=Path, default=None, help="folder for the results (default: per mode)")
    p.add_argument("--quick", action="store_true", help="reference: shorter steps and fewer runs")
    p.add_argument("--seeds", type=int, default=3, help="reference: calibrate runs (seeds 0..N-1)")
    p.add_argument("--rounds", type=int, default=3, help="reference: measurements of each reference level")
    p.add_argument("--engine", choices=("fast", "slow"), default="fast", help="twice: the engine")
    p.add_argument("--scale", type=float, default=0.5, help="twice: time scale of the slow engine")
    p.add_argument("--twice-seeds", default="0,1", help="twice: the two runs' seeds")
    p.add_argument("--flags", help="cost-idle: serve flags to use instead of calibrating")
    args = p.parse_args(argv)
    default_out = {
        "reference": "docs/img",
        "twice": "/tmp/calibrate-twice",
        "cost-idle": "/tmp/calibrate-cost-idle",
    }
    args.out = args.out or Path(default_out[args.mode])
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    {"reference": run_reference, "twice": run_twice, "cost-idle": run_cost_idle}[args.mode](args)
    print(f"(took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
