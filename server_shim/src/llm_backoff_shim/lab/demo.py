"""``llm-backoff-shim demo``: the same overload, three ways, on the built-in simulator.

    llm-backoff-shim demo [--quick] [--out DIR] [--seed N] [--duration S]

Starts the simulator (and, per shim run, a fresh shim) as child processes on free
loopback ports, then drives one seeded load (a burst, then Poisson arrivals at 2x
capacity, 70 % interactive / 30 % batch callers, each call with its own prompt and
answer length drawn from a lognormal, ``ignore_eos``) three times:

1. plain ``openai`` client straight at the engine (its unbounded queue);
2. plain ``openai`` client through the shim (openai's default 2 retries);
3. ``llm_backoff``-wrapped clients through the shim.

Prints progress while it runs, a table per configuration, a side-by-side summary,
and writes ``overload-demo.png`` (latency, queue depth and rejections over time)
and ``overload-demo.json`` (every figure) into ``--out`` (default: the current
folder). No GPU, no network. The plot needs the ``lab`` extra (matplotlib): without it
the demo says so in one line before starting anything. Exit status: 0 done, 1 a server
failed or the output could not be written, 2 bad flags or the lab extra missing, 130
interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from llm_backoff_shim.lab.calibrate.measure import HELD_RETRY_AFTER_MAX, Recommendation
from llm_backoff_shim.lab.extra import MissingLabExtraError, require_plotting
from llm_backoff_shim.lab.figures import Figures, figures
from llm_backoff_shim.lab.load_records import Progress, RunResult
from llm_backoff_shim.lab.loadgen import LoadRun, run_load
from llm_backoff_shim.lab.plots import save_plot
from llm_backoff_shim.lab.procs import (
    ServerStartError,
    shim_server,
    sigterm_as_interrupt,
    sim_server,
    start_stack,
)
from llm_backoff_shim.lab.report import explained_comparison, reading, table
from llm_backoff_shim.lab.scenario import (
    DEMO_SETUPS,
    DEMO_SHAPE,
    EngineShape,
    Scenario,
    Setup,
    arrivals,
    demo_scenario,
    profile_demo_scenario,
    varied_demo_scenario,
)
from llm_backoff_shim.sim.profiles import PROFILES

PNG_NAME = "overload-demo.png"
JSON_NAME = "overload-demo.json"


def shim_flags(shape: EngineShape, scenario: Scenario, *, hold_batch: bool = True) -> list[str]:
    """The shim as ``calibrate`` would size it for this engine and these callers.

    As many slots as the engine has; an interactive queue that nobody waits in longer than the
    interactive TTFT budget, each class's queue what the engine drains within its wait (the
    shim's own bound; the prior service time is the engine's, so it holds from the first
    request). ``hold_batch`` (calibrate's recommendation,
    :func:`llm_backoff_shim.lab.calibrate.measure.recommend`): batch callers wait in the shim
    for up to half their deadline, and hints are capped at ``HELD_RETRY_AFTER_MAX``. Without it
    every class shares the interactive bounds, and a plain client's batch calls are told to come
    back after 2 s of queue, again and again until their deadline: the demo's plain openai
    through the shim then served half its batch calls and fewer useful tokens than straight at
    the engine.
    """
    wait = scenario.ttft_budget
    batch_wait = scenario.deadline_of("batch") / 2 if hold_batch else None
    rec = Recommendation(
        max_concurrency=shape.slots,
        max_queue_wait=wait,
        batch_max_queue_wait=batch_wait,
        retry_after_max=None if batch_wait is None else HELD_RETRY_AFTER_MAX,
    )
    return [*rec.serve_flags(), "--initial-service-time", f"{shape.service_time_for(scenario.workload):.2f}"]


def describe_setup(setup: Setup, scenario: Scenario) -> str:
    interactive, batch = scenario.deadline_of("interactive"), scenario.deadline_of("batch")
    timeout = f"{interactive:g}" if interactive == batch else f"{interactive:g} or {batch:g}"
    if setup.client == "plain":
        client = f"openai.AsyncOpenAI(max_retries=2, timeout={timeout})"
    elif setup.client == "llm_backoff_presets":
        client = "llm_backoff.wrap(AsyncOpenAI(...), request_class=..., budget=RetryBudget(ratio=1.0))"
        if setup.interactive_fields:
            given = ", ".join(f"{name}={value}" for name, value in setup.interactive_fields)
            client += f", interactive: RetryPolicy.interactive({given})"
    else:
        client = (
            f"llm_backoff.wrap(AsyncOpenAI(...), RetryPolicy(deadline={timeout}, "
            f"start_deadline={scenario.ttft_budget:g} for interactive callers), "
            "request_class=..., budget=RetryBudget(ratio=1.0))"
        )
    where = {"engine": "straight at the engine", "shim": "through the shim", "peer": "through the peer"}
    return f"{client} {where[setup.route]}"


class ProgressLine:
    """One updating line on a terminal; one line per report otherwise (logs, CI)."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self._stream = stream
        self._label = label
        self._tty = stream.isatty()

    def __call__(self, p: Progress) -> None:
        queue = []
        if p.engine_waiting is not None:
            queue.append(f"engine queue {p.engine_waiting}")
        if p.proxy_queued is not None:
            queue.append(f"shim queue {p.proxy_queued}")
        text = (
            f"  [{self._label}] t={p.t:4.1f}s  started {p.sent}/{p.total}  ok {p.ok}  failed {p.failed}  "
            f"in progress {p.active}  HTTP attempts {p.attempts}  {'  '.join(queue)}"
        )
        if self._tty:
            self._stream.write("\r\x1b[2K" + text)
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def done(self) -> None:
        if self._tty:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-backoff-shim demo",
        allow_abbrev=False,
        description="Drive the same overload three ways on the built-in simulator (no GPU, no network): "
        "plain openai straight at the engine, plain openai through the shim, llm_backoff through the shim. "
        "Prints a table per configuration and writes a PNG and a JSON file.",
    )
    p.add_argument("--out", type=Path, default=Path("."), help="folder for the PNG and JSON (default: .)")
    p.add_argument(
        "--quick", action="store_true", help="a shorter load with the same budgets, ~40 s in all (for CI)"
    )
    p.add_argument("--seed", type=int, default=7, help="seed of the arrivals (default: 7)")
    p.add_argument(
        "--fixed-lengths",
        action="store_true",
        help="every call the same short prompt and 20-token answer on a 1.2 s engine (the load of "
        "earlier versions of the demo)",
    )
    p.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help="the simulator as a GPU box (llm-backoff-shim sim --profile): its sequences and pace, "
        "and a load sized to them (a burst of 3 x sequences + 16, then 2x capacity)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of sustained 2x arrivals after the burst (default: 8, or 3 with --quick)",
    )
    return p


def run_demo(
    scenario: Scenario, shape: EngineShape, seed: int, setups: Sequence[Setup], out: TextIO, err: TextIO
) -> list[RunResult]:
    capacity = shape.capacity_for(scenario.workload)
    token_capacity = shape.token_capacity_for(scenario.workload)
    calls = arrivals(scenario, capacity, random.Random(seed))
    out.write(
        f"Engine (simulator): {shape.slots} slots, {shape.service_time_for(scenario.workload):.2f} s "
        f"per request on average -> capacity {capacity:.2f} requests/s ({token_capacity:.0f} answer "
        "tokens/s)\n"
        f"Load: {len(calls)} calls, {scenario.describe(capacity)}; "
        f"interactive TTFT budget {scenario.ttft_budget:g} s; seed {seed}\n"
        f"Shim: {' '.join(shim_flags(shape, scenario))}\n\n"
    )
    out.flush()
    results: list[RunResult] = []
    with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
        sim = sim_server(shape.sim_flags())
        # A fresh shim per shim run, so no run inherits another's drain estimate; all
        # are started together because Python start-up is most of a server's start time.
        shims = {
            id(setup): shim_server(sim, shim_flags(shape, scenario))
            for setup in setups
            if setup.route == "shim"
        }
        for server in (sim, *shims.values()):
            stack.callback(server.close)
        start_stack(sim, list(shims.values()))
        for n, setup in enumerate(setups, 1):
            out.write(f"[{n}/{len(setups)}] {setup.label}: {describe_setup(setup, scenario)}\n")
            out.flush()
            shim = shims.get(id(setup))
            line = ProgressLine(err, setup.label)
            run = LoadRun(
                setup,
                scenario,
                calls,
                target_url=sim.url if shim is None else shim.url,
                engine_url=sim.url,
                shim_url=None if shim is None else shim.url,
                capacity=capacity,
                progress=line,
                token_capacity=token_capacity,
            )
            result = run_load(run)
            line.done()
            if shim is not None:
                shim.close()
            if not sim.alive():
                raise ServerStartError(f"the simulator exited during the run; its output:\n{sim.log_tail()}")
            results.append(result)
            out.write(table(figures(result)) + f"\n  (run took {result.elapsed:.1f} s)\n\n")
            out.flush()
    return results


def write_outputs(
    results: Sequence[RunResult], all_figures: Sequence[Figures], folder: Path, scenario: Scenario, seed: int
) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    title = f"llm-backoff-shim demo: {scenario.describe(results[0].capacity)} (seed {seed})"
    png = save_plot(results, folder / PNG_NAME, title=title)
    data = {
        "scenario": {
            "name": scenario.name,
            "burst": scenario.burst,
            "rate_factor": scenario.rate_factor,
            "duration": scenario.duration,
            "deadline": scenario.deadline,
            "ttft_budget": scenario.ttft_budget,
            "interactive_share": scenario.interactive_share,
            "batch_deadline": scenario.deadline_of("batch"),
            "workload": None if scenario.workload is None else scenario.workload.describe(),
            "seed": seed,
        },
        "runs": [f.as_dict() for f in all_figures],
    }
    json_path = folder / JSON_NAME
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    return png, json_path


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:  # before a minute of load, not after it
        require_plotting(f"the overload plot ({PNG_NAME})")
    except MissingLabExtraError as exc:
        print(f"llm-backoff-shim demo: {exc}", file=sys.stderr)
        return 2
    if args.duration is not None and not 0 < args.duration <= 600:
        print("llm-backoff-shim demo: --duration must be in (0, 600] seconds", file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"llm-backoff-shim demo: --out {args.out} is not a folder", file=sys.stderr)
        return 2
    try:  # find out now rather than after a minute of load
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"llm-backoff-shim demo: --out {args.out}: {exc}", file=sys.stderr)
        return 2
    if not os.access(args.out, os.W_OK):
        print(f"llm-backoff-shim demo: --out {args.out} is not writable", file=sys.stderr)
        return 2
    if args.fixed_lengths and args.profile:
        print("llm-backoff-shim demo: --fixed-lengths and --profile do not go together", file=sys.stderr)
        return 2
    if args.profile:
        shape = EngineShape.from_profile(args.profile)
        scenario = profile_demo_scenario(shape, quick=args.quick, duration=args.duration)
    elif args.fixed_lengths:
        shape = EngineShape()
        scenario = demo_scenario(quick=args.quick, duration=args.duration)
    else:
        shape = DEMO_SHAPE
        scenario = varied_demo_scenario(quick=args.quick, duration=args.duration)
    started = time.monotonic()
    try:
        results = run_demo(scenario, shape, args.seed, DEMO_SETUPS, sys.stdout, sys.stderr)
    except KeyboardInterrupt:
        print("\nllm-backoff-shim demo: interrupted; servers stopped", file=sys.stderr)
        return 130
    except ServerStartError as exc:
        print(f"llm-backoff-shim demo: {exc}", file=sys.stderr)
        return 1
    all_figures = [figures(r) for r in results]
    print("Summary (same load, same seed, three configurations):")
    print(explained_comparison(all_figures, scenario))
    print()
    print(textwrap.fill(reading(all_figures, scenario.deadline_of("batch") / 2), width=100))
    try:
        png, json_path = write_outputs(results, all_figures, args.out, scenario, args.seed)
    except OSError as exc:
        print(
            f"llm-backoff-shim demo: cannot write the plot or figures into {args.out}: {exc}", file=sys.stderr
        )
        return 1
    print(f"\nPlot: {png.resolve()}\nFigures: {json_path.resolve()}")
    print(f"Done in {time.monotonic() - started:.0f} s.")
    return 0
