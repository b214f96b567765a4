"""How interactive callers fare under the start-deadline policies, in the shim's virtual-time model.

The shim's overload model (``llm_backoff_shim.lab.overload_model``: the shim's real admission
decisions against callers making ``llm_backoff``'s real retry decisions, on a virtual
clock) plays the overload scenarios over many seeds. Interactive callers get one of:

- ``patient``: ``RetryPolicy(deadline=D)``, no start deadline;
- ``start``: ``RetryPolicy(deadline=D, start_deadline=B)`` (B = the scenario's TTFT budget);
- ``preset:F``: ``RetryPolicy.interactive(start_deadline=B, deadline=D, last_chance=F)``.

Batch callers keep ``RetryPolicy(deadline=D)``. Per scenario and policy: interactive calls
that began within their TTFT budget, the p90 time to failure of the interactive calls that
failed, and batch calls served. No sockets, no sleeping: a few seconds per policy.

    .venv/bin/python bench/bench_interactive_presets.py --seeds 20 --service-jitter 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import llm_backoff_shim.lab.overload_model as model
from bench_overload import scenarios
from llm_backoff import RetryPolicy
from llm_backoff_shim.lab.demo import shim_flags
from llm_backoff_shim.lab.scenario import EngineShape, RequestClass, Scenario, demo_scenario


def policy_maker(mode: str) -> Callable[..., RetryPolicy]:
    def policy(cls: RequestClass, scenario: Scenario, *, start_deadline: bool = True) -> RetryPolicy:
        if cls != "interactive" or mode == "patient":
            return RetryPolicy(deadline=scenario.deadline)
        if mode == "start":
            return RetryPolicy(deadline=scenario.deadline, start_deadline=scenario.ttft_budget)
        fraction = float(mode.split(":", 1)[1])
        return RetryPolicy.interactive(
            start_deadline=scenario.ttft_budget, deadline=scenario.deadline, last_chance=fraction
        )

    return policy


def measure(scenario: Scenario, mode: str, seeds: int, jitter: float) -> dict[str, float]:
    model.retry_policy = policy_maker(mode)  # the model looks the policy up per call
    shape = EngineShape()
    flags = shim_flags(shape, scenario, hold_batch=False)
    in_budget = interactive = batch = batch_ok = 0
    failures: list[float] = []
    for seed in range(1, seeds + 1):
        result = model.OverloadModel(scenario, shape, flags, seed=seed, service_jitter=jitter).run()
        for call in result.calls:
            if call.arrival.cls != "interactive":
                batch += 1
                batch_ok += call.ok
                continue
            interactive += 1
            if call.ok and call.first_token is not None:
                in_budget += call.first_token - call.start <= scenario.ttft_budget
            elif not call.ok and call.end is not None:
                failures.append(call.end - call.start)
        print(f"\r  {scenario.name} {mode}: {seed}/{seeds}", end="", file=sys.stderr, flush=True)
    failures.sort()
    p90 = failures[int(0.9 * (len(failures) - 1))] if failures else float("nan")
    return {
        "in_budget": in_budget,
        "interactive": interactive,
        "fail_p90": p90,
        "batch_ok": batch_ok,
        "batch": batch,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--service-jitter", type=float, default=0.5)
    p.add_argument("--modes", default="patient,start,preset:0,preset:0.5,preset:1.0")
    p.add_argument("--plot", type=Path, default=Path("docs/img/interactive_presets.png"))
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    every = (*scenarios(quick=False), demo_scenario(quick=False))
    chosen = [dataclasses.replace(s, start_deadline=True) for s in every]
    started = time.monotonic()
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for scenario in chosen:
        rows[scenario.name] = {m: measure(scenario, m, args.seeds, args.service_jitter) for m in modes}
    print(file=sys.stderr)
    print(
        f"{args.seeds} seeds, service jitter {args.service_jitter:g}, {time.monotonic() - started:.0f} s\n\n"
        "| scenario (TTFT budget) | policy | interactive within budget | vs `start` | "
        "interactive failures: p90 time to failure | batch served |\n|---|---|---:|---:|---:|---:|"
    )
    for scenario in chosen:
        reference = rows[scenario.name].get("start", {}).get("in_budget")
        for mode in modes:
            r = rows[scenario.name][mode]
            ratio = f"{r['in_budget'] / reference:.3f}" if reference else "-"
            print(
                f"| {scenario.name} ({scenario.ttft_budget:g} s) | `{mode}` | "
                f"{r['in_budget']:.0f} / {r['interactive']:.0f} | {ratio} | {r['fail_p90']:.2f} s | "
                f"{r['batch_ok']:.0f} / {r['batch']:.0f} |"
            )
    save(rows, chosen, modes, args.plot)
    print(f"\nplot: {args.plot}")
    return 0


def save(
    rows: dict[str, dict[str, dict[str, float]]], chosen: Sequence[Scenario], modes: Sequence[str], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(chosen), figsize=(4 * len(chosen), 3.6), squeeze=False)
    for ax, scenario in zip(axes[0], chosen, strict=True):
        share = [rows[scenario.name][m]["in_budget"] / rows[scenario.name][m]["interactive"] for m in modes]
        ax.bar(range(len(modes)), share, color="tab:blue")
        ax.set_xticks(range(len(modes)), modes, rotation=30, fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(f"{scenario.name} (budget {scenario.ttft_budget:g} s)", fontsize=9)
        ax.set_ylabel("interactive within TTFT budget", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    raise SystemExit(main())
