"""The comparison on a real vLLM: one command, from nothing to a table and a PNG.

    .venv/bin/python bench/bench_vllm.py            # ~13 min: 3 seeds x 4 configurations, 30 s of arrivals
    .venv/bin/python bench/bench_vllm.py --quick    # ~3 min: 1 seed, 10 s of arrivals

Wrap it in the machine-wide lock when others share the machine:
``flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_vllm.py``.

What it does, in order:

1. sets up vLLM (CPU build) and a small random-weight Llama when they are missing
   (``bench/real_vllm/setup.sh``; a few minutes, once);
2. starts ``vllm serve`` with ``--max-num-seqs 8`` pinned to CPU 1, and pins itself (the
   load generator) and every other child to CPU 0;
3. runs ``llm-backoff-shim calibrate`` against it and keeps the recommended ``serve``
   flags and the answer tokens/s at the knee (the engine's capacity for the ceiling);
4. drives the same seeded load against each configuration, a fresh shim (calibrate's
   flags) for each: Poisson arrivals at ``--rate-factor`` x capacity for ``--duration``
   s, answer lengths lognormal (median 64, sigma 0.8, at most 512, forced with
   ``ignore_eos``), prompts of 5-200 words, 70 % interactive callers with a 5 s TTFT
   budget, 30 % batch, 20 s deadline per call. Configurations: plain openai straight at
   vLLM; plain openai through the shim; ``llm_backoff.wrap(..., request_class=cls)``
   through the shim with the call's deadline only; the same with the interactive
   callers' budget stated (``start_deadline=5``);
5. prints a table of medians over the seeds (each seed's value beside it), writes a PNG,
   a JSON of every cell and a Markdown table into ``--out``.

The load generator is :mod:`llm_backoff_shim.lab.loadgen` (the demo's and the overload
benchmark's); the figures are :mod:`llm_backoff_shim.lab.figures`'s plus those in
:mod:`real_vllm.measures`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from llm_backoff_shim.lab import calibrate
from llm_backoff_shim.lab.demo import ProgressLine
from llm_backoff_shim.lab.figures import figures
from llm_backoff_shim.lab.load_records import RunResult
from llm_backoff_shim.lab.loadgen import LoadRun, run_load
from llm_backoff_shim.lab.procs import (
    ChildServer,
    ServerStartError,
    cli_command,
    shim_server,
    sigterm_as_interrupt,
)
from llm_backoff_shim.lab.scenario import Scenario, Setup, arrivals
from llm_backoff_shim.lab.workload import Workload
from real_vllm import plot
from real_vllm.capacity import full_load_tokens_per_s
from real_vllm.engine import DEFAULT_ENV, DEFAULT_MODEL, ensure_setup, vllm_server
from real_vllm.measures import (
    Cell,
    idle_markdown,
    interactive_failure_paths,
    markdown_table,
    text_table,
)

LOAD_CPU = 0
ENGINE_CPU = 1
SLOTS = 8
TTFT_SLO = 2.0  # calibrate's own default: the p99 TTFT a team asks of the engine


@dataclass(frozen=True)
class Config:
    setup: Setup
    start_deadline: bool


CONFIGS = {
    "direct": Config(Setup("plain openai, direct", "engine", "plain"), False),
    "shim-plain": Config(Setup("plain openai, shim", "shim", "plain"), False),
    "shim-backoff": Config(Setup("llm_backoff, shim", "shim", "llm_backoff"), False),
    "shim-presets": Config(Setup("llm_backoff presets, shim", "shim", "llm_backoff_presets"), False),
    "shim-budgets": Config(Setup("llm_backoff + budgets, shim", "shim", "llm_backoff"), True),
    "shim-presets-hints-1s": Config(
        Setup(
            "llm_backoff presets, hints <= 1 s, shim",
            "shim",
            "llm_backoff_presets",
            (("max_retry_after", 1.0),),
        ),
        False,
    ),
    "shim-presets-hint-cap-only": Config(
        Setup(
            "llm_backoff presets, hint cap only, shim",
            "shim",
            "llm_backoff_presets",
            (("max_retry_at", None),),
        ),
        False,
    ),
}
#: The comparison the benchmark is for; the other configurations measure one choice each.
DEFAULT_SETUPS = ("direct", "shim-plain", "shim-presets", "shim-budgets")


@dataclass(frozen=True)
class Calibration:
    flags: list[str]
    knee_concurrency: int
    tokens_per_s: float
    requests_per_s: float
    command: str
    seconds: float


def scenario(duration: float, rate_factor: float) -> Scenario:
    return Scenario(
        "real-vllm",
        burst=0,
        rate_factor=rate_factor,
        duration=duration,
        deadline=20.0,
        ttft_budget=5.0,
        interactive_share=0.7,
        workload=Workload(),
    )


def calibrate_lengths(workload: Workload) -> tuple[str, str]:
    """The workload's own length specs when this calibrate reads them, else uniform ranges
    of about the same means (prompt words 5-200, answer tokens 16-160)."""
    specs = (str(workload.prompt_words), str(workload.output_tokens))
    args = ["--upstream", "http://127.0.0.1:1", "--prompt-words", specs[0], "--output-tokens", specs[1]]
    try:
        calibrate.config_from_args(calibrate.build_parser().parse_args(args))
    except (Exception, SystemExit):
        return "5-200", "16-160"
    return specs


def run_calibrate(url: str, workload: Workload, *, quick: bool, slo: float) -> Calibration:
    prompt, output = calibrate_lengths(workload)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        argv = cli_command(
            "calibrate",
            "--upstream",
            url,
            "--ttft-slo",
            f"{slo:g}",
            "--max-level",
            "32",
            "--step-seconds",
            "5" if quick else "10",
            "--prompt-words",
            prompt,
            "--output-tokens",
            output,
            "--max-seconds",
            "90" if quick else "180",
            "--out",
            tmp,
            "--json",
        )
        print("$ " + " ".join(argv[1:]), flush=True)
        done = subprocess.run(argv, stdout=subprocess.PIPE, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"calibrate found no recommendation (exit {done.returncode})")
    data: dict[str, Any] = json.loads(done.stdout)
    rec = data["recommendation"]
    knee: dict[str, Any] = data["knee"]
    if "output_tokens_per_s" not in knee:  # a calibrate whose knee names only its level
        knee = next(s for s in data["steps"] if s["concurrency"] == knee["concurrency"])
    command = str(rec["command"])
    return Calibration(
        serve_flags(command),
        int(knee["concurrency"]),
        float(knee["output_tokens_per_s"]),
        float(knee.get("requests_per_s", knee.get("throughput", 0.0))),
        command,
        time.monotonic() - started,
    )


def serve_flags(command: str) -> list[str]:
    """The flags of calibrate's ``llm-backoff-shim serve --upstream URL ...`` after the URL."""
    words = shlex.split(command)
    if "--upstream" not in words:
        raise RuntimeError(f"calibrate's command has no --upstream: {command!r}")
    return words[words.index("--upstream") + 2 :]


def model_name(url: str) -> str:
    name: str = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return name


def run_cell(
    config: Config,
    base: Scenario,
    seed: int,
    engine_url: str,
    calib: Calibration,
    model: str,
    capacity: float,
    full: float,
) -> tuple[RunResult, Cell]:
    scen = dataclasses.replace(base, start_deadline=config.start_deadline)
    calls = arrivals(scen, capacity, random.Random(seed))
    with contextlib.ExitStack() as stack:
        front: ChildServer | None = None
        if config.setup.route == "shim":
            front = stack.enter_context(shim_server(engine_url, calib.flags))
        load = os.getloadavg()[0]
        print(
            f"- seed {seed}, {config.setup.label}: {len(calls)} calls (machine load {load:.1f})", flush=True
        )
        line = ProgressLine(sys.stderr, f"seed {seed} / {config.setup.label}")
        run = LoadRun(
            config.setup,
            scen,
            calls,
            target_url=engine_url if front is None else front.url,
            engine_url=engine_url,
            shim_url=None if front is None else front.url,
            capacity=capacity,
            model=model,
            progress=line,
            start_deadline=config.start_deadline,
            token_capacity=calib.tokens_per_s,
        )
        result = run_load(run)
        line.done()
    cell = Cell.of(result, figures(result), seed=seed, slots=SLOTS, load=load, full_tokens_per_s=full)
    print(
        f"  useful {cell.useful_tokens} tokens ({_pct(cell.useful_fraction)} of capacity), interactive "
        f"{cell.interactive_within_budget}/{cell.interactive_calls} within budget, batch served "
        f"{_pct(cell.batch_served)}, wasted {_pct(cell.wasted_share)}, idle {_pct(cell.idle_share)} "
        f"({result.elapsed:.0f} s)",
        flush=True,
    )
    if cell.idle_places and cell.idle_share:
        shown = ", ".join(f"{place} {_pct(share)}" for place, share in cell.idle_places.items())
        print(f"  idle while the caller was: {shown}", flush=True)
    paths = interactive_failure_paths(result)
    if paths:
        shown = ", ".join(
            f"{path} {count} (p90 {'-' if p90 is None else f'{p90:.2f} s'})"
            for path, (count, p90) in paths.items()
        )
        print(f"  interactive failures: {shown}", flush=True)
    return result, cell


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def pin_self(cpu: int) -> bool:
    """Run this process (and the children it starts) on ``cpu``; False where not possible."""
    if cpu not in os.sched_getaffinity(0) or len(os.sched_getaffinity(0)) < 2:
        return False
    os.sched_setaffinity(0, {cpu})
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--quick", action="store_true", help="1 seed and 10 s of arrivals (about 3 minutes)")
    add("--seeds", type=int, help="how many seeds (default 3, 1 with --quick)")
    add("--first-seed", type=int, default=1)
    add("--duration", type=float, help="seconds of arrivals (default 30, 10 with --quick)")
    add("--rate-factor", type=float, default=2.0, help="arrival rate / capacity (default %(default)s)")
    add(
        "--setups",
        default=",".join(DEFAULT_SETUPS),
        help=f"comma-separated, of {', '.join(CONFIGS)} (default %(default)s)",
    )
    add("--out", type=Path, default=Path("docs/img"), help="folder for the PNG, JSON and Markdown")
    add("--name", default="real-vllm", help="file name stem of the outputs (default %(default)s)")
    add("--engine-url", help="use this running vLLM instead of starting one (it must run --max-num-seqs 8)")
    add("--env", type=Path, default=DEFAULT_ENV, help="the vLLM venv (default %(default)s)")
    add("--model", type=Path, default=DEFAULT_MODEL, help="the model folder (default %(default)s)")
    add("--ttft-slo", type=float, default=TTFT_SLO, help="calibrate's --ttft-slo (default %(default)s)")
    add(
        "--shim-flags",
        help="serve flags for the shim instead of calibrate's recommendation, e.g. "
        "'--max-concurrency 8 --max-queue 16' (calibrate still runs, for its knee's tokens/s, "
        "unless --knee-tokens-per-s is given too)",
    )
    add(
        "--knee-tokens-per-s",
        type=float,
        help="with --shim-flags: calibrate's answer tokens/s at its knee, stated instead of measured "
        "(calibrate does not run; the ceiling of the capacity column)",
    )
    add(
        "--capacity-tokens-per-s",
        type=float,
        help="answer tokens/s with every slot busy, stated instead of measured: the arrivals are "
        "--rate-factor x this, so runs on other days or branches face the same load",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.knee_tokens_per_s is not None and args.shim_flags is None:
        parser.error("--knee-tokens-per-s needs --shim-flags (it stands in for calibrate's run)")
    for name in ("knee_tokens_per_s", "capacity_tokens_per_s"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {value:g}")
    seeds = list(range(args.first_seed, args.first_seed + (args.seeds or (1 if args.quick else 3))))
    unknown = set(args.setups.split(",")) - set(CONFIGS)
    if unknown:
        print(f"bench_vllm: unknown setups {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    configs = [CONFIGS[name] for name in args.setups.split(",")]
    base = scenario(args.duration or (10.0 if args.quick else 30.0), args.rate_factor)
    started = time.monotonic()
    pinned = pin_self(LOAD_CPU)
    print(
        f"load generator, shim and calibrate on CPU {LOAD_CPU}, vLLM on CPU {ENGINE_CPU}"
        if pinned
        else "not pinned (fewer than 2 CPUs usable)",
        flush=True,
    )
    cells: list[Cell] = []
    timeline: list[RunResult] = []
    try:
        with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
            engine: ChildServer | None = None
            if args.engine_url:
                url = args.engine_url.rstrip("/")
            else:
                ensure_setup(args.env, args.model)
                print("starting vllm serve (about 25 s) ...", flush=True)
                engine = stack.enter_context(
                    vllm_server(
                        slots=SLOTS, env=args.env, model=args.model, cpu=ENGINE_CPU if pinned else None
                    )
                )
                url = engine.url
                print(f"vLLM up at {url} after {time.monotonic() - started:.0f} s", flush=True)
            model = model_name(url)
            workload = base.workload or Workload()
            if args.shim_flags is not None and args.knee_tokens_per_s is not None:
                calib = Calibration(
                    shlex.split(args.shim_flags), SLOTS, args.knee_tokens_per_s, 0.0, "(stated)", 0.0
                )
            else:
                calib = run_calibrate(url, workload, quick=args.quick, slo=args.ttft_slo)
            if args.shim_flags is not None:
                calib = dataclasses.replace(calib, flags=shlex.split(args.shim_flags))
            print(
                f"calibrate ({calib.seconds:.0f} s): knee at {calib.knee_concurrency} in flight, "
                f"{calib.tokens_per_s:.0f} answer tokens/s; shim flags {' '.join(calib.flags)}",
                flush=True,
            )
            full = args.capacity_tokens_per_s or full_load_tokens_per_s(
                url, model, workload, slots=SLOTS, seconds=5.0 if args.quick else 10.0
            )
            mean_tokens = workload.output_tokens.mean()
            capacity = full / mean_tokens
            print(
                f"all {SLOTS} slots busy (closed loop, this workload): {full:.0f} answer tokens/s\n"
                f"load: {base.describe(capacity)} (capacity {capacity:.2f} req/s at a mean answer "
                f"of {mean_tokens:.0f} tokens); seeds {seeds}",
                flush=True,
            )
            for seed in seeds:
                for config in configs:
                    result, cell = run_cell(config, base, seed, url, calib, model, capacity, full)
                    cells.append(cell)
                    if seed == seeds[0]:
                        timeline.append(result)
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130
    except (ServerStartError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"bench_vllm: {exc}", file=sys.stderr)
        return 1
    labels = [c.setup.label for c in configs]
    loads = [c.load_average for c in cells]
    window = base.duration + base.deadline_of("batch")
    head = (
        f"vLLM {SLOTS} slots; calibrate: {calib.command} (knee {calib.knee_concurrency}, "
        f"shim run with {' '.join(calib.flags)}; "
        f"{calib.tokens_per_s:.0f} tokens/s, ceiling {calib.tokens_per_s * window / 1000:.1f}k useful "
        f"tokens); all slots busy: {full:.0f} tokens/s (ceiling {full * window / 1000:.1f}k); "
        f"{len(seeds)} seed(s); machine load {min(loads):.1f}-{max(loads):.1f}"
    )
    idle = idle_markdown(labels, cells)
    print("\n" + head + "\nmedian over seeds (each seed's value in brackets):\n" + text_table(labels, cells))
    if idle:
        print("\n" + idle)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    png = plot.save(
        labels,
        cells,
        timeline,
        SLOTS,
        args.out / f"{args.name}{suffix}.png",
        f"real vLLM (CPU), {base.describe(capacity)}; shim: {' '.join(calib.flags)}",
    )
    (args.out / f"{args.name}{suffix}.json").write_text(
        json.dumps(
            {
                "calibration": dataclasses.asdict(calib),
                "full_load_tokens_per_s": full,
                "scenario": base.describe(capacity),
                "cells": [dataclasses.asdict(c) for c in cells],
            },
            indent=1,
        )
        + "\n"
    )
    (args.out / f"{args.name}{suffix}.md").write_text(
        head + "\n\n" + markdown_table(labels, cells) + "\n" + (f"\n{idle}\n" if idle else "")
    )
    print(f"\nplot: {png}\nMarkdown: {args.out / f'{args.name}{suffix}.md'}")
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
