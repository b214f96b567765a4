"""Issue 7's overload scenarios in virtual time, over many seeds (llm_backoff_shim.lab.overload_model).

The shim's admission decisions, built from the same flags as in bench_overload.py, against
callers that make llm_backoff's retry decisions, on an engine that takes exactly its service
time (with --lengths, each call's own): no sockets, no sleeping, about 0.1 s per run. The real
benchmark's success count moves by 2-3 between runs of the same code; this shows a change to
admission over 20-100 seeds in seconds, so it can be judged before the real runs, which remain
the judge of the figures.

    .venv/bin/python bench/bench_admission_model.py --seeds 30
    # a before/after: the other tree's sources first on the path
    PYTHONPATH=/tmp/before/src:/tmp/before/server_shim/src .venv/bin/python bench/bench_admission_model.py

Per scenario (issue 7's three, and the demo's load), over the seeds: calls served within the
deadline (and the fewest in one run), interactive calls served, attempts per call, share of
first retries admitted, the largest retry wave (100 ms), the worst interactive TTFT p99, the
engine's idle slot-seconds before its last completion, the refusals that came after a
wait in the queue (all others are at once: these set a p99 time to rejection), the share of
the engine's slot-time idle while a caller that could still have been served waited, and
useful tokens over the capacity bound (medians over the seeds).

    # varied output lengths (asked as max_tokens), plus the varied-2x scenarios; a PNG and
    # the per-seed figures beside the table, a reference run's figures side by side
    .venv/bin/python bench/bench_admission_model.py --seeds 20 --lengths 20,0.8,160 \
        --json after.json --plot after.png --before before.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench_overload import scenarios
from llm_backoff_shim.lab.demo import shim_flags
from llm_backoff_shim.lab.overload_model import OutputLengths, OverloadModel, service_of
from llm_backoff_shim.lab.overload_results import ModelResult
from llm_backoff_shim.lab.scenario import EngineShape, Scenario, demo_scenario


def varied_scenarios(shape: EngineShape, lengths: OutputLengths) -> list[tuple[Scenario, list[str]]]:
    """A load like the real-engine comparison's: 2x capacity for 30 s, 70 % interactive callers
    that must begin within 5 s, a 20 s deadline per call; once behind the demo's sizing (a
    queue of two batches, nobody waits longer than the TTFT budget), once behind a sizing like
    ``calibrate``'s on that engine (5 queue places, a queue wait of one mean service time)."""
    scenario = Scenario("varied-2x", burst=0, rate_factor=2.0, duration=30, deadline=20, ttft_budget=5)
    mean_service = service_of(shape, 1) + (lengths.mean() - 1) * shape.itl
    calibrated = [
        "--max-concurrency",
        str(shape.slots),
        "--max-queue",
        "5",
        "--max-queue-wait",
        f"{mean_service:.2f}",
        "--initial-service-time",
        f"{mean_service:.2f}",
    ]
    small = dataclasses.replace(scenario, name="varied-2x-small-queue")
    return [(scenario, shim_flags(shape, scenario, hold_batch=False)), (small, calibrated)]


def summarize(scenario: Scenario, results: Sequence[ModelResult]) -> list[str]:
    calls = sum(len(r.calls) for r in results)
    ok = sum(r.successes for r in results)
    interactive = sum(sum(c.ok for c in r.calls if c.arrival.cls == "interactive") for r in results)
    admitted = sum(r.first_retry_admitted[0] for r in results)
    retried = sum(r.first_retry_admitted[1] for r in results)
    p99s = [p for r in results if (p := r.ttft_p99()) is not None]
    return [
        scenario.name + ("" if scenario.start_deadline else " (no start deadline)"),
        f"{ok}/{calls} = {ok / calls:.1%}",
        str(min(r.successes for r in results)),
        str(interactive),
        f"{sum(r.attempts for r in results) / calls:.2f}",
        f"{admitted / retried:.1%}" if retried else "-",
        str(max(r.largest_retry_wave for r in results)),
        f"{max(p99s):.2f} s" if p99s else "-",
        f"{sum(r.idle_slot_seconds for r in results) / len(results):.1f}",
        f"{sum(len(r.refused_after_a_wait) for r in results)} of "
        f"{sum(len(c.refusal_times) for r in results for c in r.calls)}",
        f"{_median([r.idle_while_servable_share for r in results]):.1%} "
        f"(max {max(r.idle_while_servable_share for r in results):.1%})",
        f"{_median([r.useful_share for r in results]):.2f}",
    ]


def measures(results: Sequence[ModelResult]) -> dict[str, list[float]]:
    """Per seed: idle share while a caller could be served, useful / capacity, share served."""
    return {
        "idle_while_servable": [r.idle_while_servable_share for r in results],
        "useful": [r.useful_share for r in results],
        "served": [r.successes / len(r.calls) for r in results],
    }


Runs = Mapping[str, Mapping[str, Sequence[float]]]


def save_plot(path: Path, after: Runs, before: Runs | None, title: str) -> None:
    """Per scenario: median (bars) and range over seeds (whiskers), before beside after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(after)
    panels = (
        ("idle_while_servable", "slot-time idle while a caller could be served", 100.0, "%"),
        ("served", "calls served within the deadline", 100.0, "%"),
        ("useful", "useful tokens / capacity bound", 1.0, ""),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5))
    sets: list[tuple[str, Runs | None, str]] = [("", after, "tab:blue")]
    if before:
        sets = [("before", before, "tab:gray"), ("after", after, "tab:blue")]
    width = 0.8 / len(sets)
    for ax, (key, label, scale, unit) in zip(axes, panels, strict=True):
        for i, (tag, runs, colour) in enumerate(sets):
            assert runs is not None
            xs, mids, lows, highs = [], [], [], []
            for j, name in enumerate(names):
                values = runs.get(name, {}).get(key)
                if not values:
                    continue
                mid = _median(values) * scale
                xs.append(j + (i - (len(sets) - 1) / 2) * width)
                mids.append(mid)
                lows.append(mid - min(values) * scale)
                highs.append(max(values) * scale - mid)
            ax.bar(xs, mids, width, yerr=[lows, highs], color=colour, label=tag or None, capsize=3)
        if key == "idle_while_servable":
            ax.axhline(2.0, color="tab:red", linestyle="--", linewidth=1, label="target 2 %")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        if unit:
            ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=30, help="runs per scenario, seeds 1..N")
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument(
        "--start-deadline-everywhere",
        action="store_true",
        help="interactive callers state their TTFT budget in the burst too (bench_overload's flag)",
    )
    p.add_argument(
        "--shim-flag", action="append", default=[], help="an extra shim flag (repeat; e.g. =--x=y)"
    )
    p.add_argument(
        "--service-jitter",
        type=float,
        default=0.0,
        help="each request holds its slot service time x U(1 - j, 1 + j) (default 0: exact)",
    )
    p.add_argument(
        "--lengths",
        default="",
        metavar="MEDIAN,SIGMA,CAP",
        help="output tokens per call from a lognormal (e.g. 20,0.8,160), asked as max_tokens with "
        "ignore_eos; adds the varied-2x scenarios (default: every call the shape's 20 tokens)",
    )
    p.add_argument("--json", type=Path, help="write each scenario's per-seed measures here")
    p.add_argument("--plot", type=Path, help="write a PNG of the measures here (with --before: side by side)")
    p.add_argument("--before", type=Path, help="a --json file of the reference run, for --plot")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if not 0 <= args.service_jitter < 1:
        p.error("--service-jitter must be in [0, 1)")
    lengths = None
    if args.lengths:
        try:
            median, sigma, cap = args.lengths.split(",")
            lengths = OutputLengths(float(median), float(sigma), int(cap))
        except ValueError as exc:
            p.error(f"--lengths {args.lengths}: {exc} (want MEDIAN,SIGMA,CAP)")
    shape = EngineShape()
    every = [*scenarios(quick=False), demo_scenario(quick=False)]
    chosen = [(s, shim_flags(shape, s, hold_batch=False)) for s in every]
    if lengths is not None:
        chosen += varied_scenarios(shape, lengths)
    if args.start_deadline_everywhere:
        chosen = [(dataclasses.replace(s, start_deadline=True), f) for s, f in chosen]
    if args.only:
        chosen = [(s, f) for s, f in chosen if s.name in set(args.only.split(","))]
        if not chosen:
            p.error(f"--only {args.only}: no such scenario")
    header = [
        "scenario",
        "served within deadline",
        "fewest in a run",
        "interactive served",
        "attempts per call",
        "first retry admitted",
        "largest retry wave",
        "worst interactive TTFT p99",
        "idle slot-s per run",
        "refusals after a wait",
        "idle while a caller could be served (median)",
        "useful / capacity (median)",
    ]
    rows = []
    runs: dict[str, dict[str, list[float]]] = {}
    started = time.monotonic()
    for scenario, sizing in chosen:
        flags = [*sizing, *args.shim_flag]
        results = []
        for seed in range(1, args.seeds + 1):
            model = OverloadModel(
                scenario, shape, flags, seed=seed, service_jitter=args.service_jitter, lengths=lengths
            )
            results.append(model.run())
            print(f"\r{scenario.name}: {seed}/{args.seeds} runs", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        rows.append(summarize(scenario, results))
        runs[scenario.name] = measures(results)
    print(f"{args.seeds} seeds per scenario, {time.monotonic() - started:.1f} s\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" + "---:|" * (len(header) - 1))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    if args.plot is not None:
        before = json.loads(args.before.read_text()) if args.before is not None else None
        lengths_note = f", output lengths lognormal {args.lengths}" if args.lengths else ", fixed lengths"
        save_plot(args.plot, runs, before, f"admission model, {args.seeds} seeds{lengths_note}")
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
