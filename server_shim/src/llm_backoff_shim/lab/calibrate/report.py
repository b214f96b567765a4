"""What ``llm-backoff-shim calibrate`` prints and draws: the levels' table, the
serve command, JSON, PNG.

Pure functions of an :class:`~llm_backoff_shim.lab.calibrate.run.Outcome` (the PNG aside).
Figures per level are the medians of its measurements, as the knee rule judges them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_backoff_shim.serve.config.file import render_config
from llm_backoff_shim.serve.config.settings import ShimSettings

from ..extra import require_plotting
from .measure import INTERACTIVE_BUDGET, StepStats, Verdict, queue_waived, rate
from .run import duration_text

if TYPE_CHECKING:
    from .run import Outcome


def serve_command(outcome: Outcome) -> str | None:
    if outcome.recommendation is None:
        return None
    flags = [
        "llm-backoff-shim",
        "serve",
        "--upstream",
        outcome.upstream,
        *outcome.recommendation.serve_flags(),
    ]
    return " ".join(flags)


def recommended_config(outcome: Outcome) -> str | None:
    """The recommendation as a ``serve --config`` file (every other setting commented out)."""
    rec = outcome.recommendation
    if rec is None:
        return None
    cfg = outcome.config
    active: dict[str, object] = {
        "upstream": outcome.upstream,
        "max_concurrency": rec.max_concurrency,
        "max_queue_wait": rec.max_queue_wait,
    }
    if rec.batch_max_queue_wait is not None:
        active["class_max_queue_wait"] = {"batch": rec.batch_max_queue_wait}
    if rec.retry_after_max is not None:
        active["retry_after_max"] = rec.retry_after_max
    budget = ""
    if rec.max_inflight_tokens is not None:
        if "max_inflight_tokens" in ShimSettings.model_fields:
            active["max_inflight_tokens"] = rec.max_inflight_tokens
        else:  # a shim without the cost cap: the budget is still worth knowing
            budget = f" Cost budget measured: --max-inflight-tokens {rec.max_inflight_tokens}."
    return render_config(
        active,
        header=(
            f"llm-backoff-shim serve --config FILE: recommended by llm-backoff-shim calibrate for "
            f"{outcome.upstream}",
            f"(model {outcome.model!r}, SLO p99 TTFT {cfg.ttft_slo:g} s; knee: {outcome.knee.reason}).",
            "Flags and LLM_BACKOFF_SHIM_* variables win over this file (flag > env > file > default)."
            + budget,
        ),
    )


def _median(steps: Sequence[StepStats], name: str) -> float:
    return float(statistics.median(getattr(s, name) for s in steps))


def _notes(outcome: Outcome, v: Verdict) -> str:
    notes = []
    if v.concurrency == outcome.knee.level:
        notes.append("KNEE")
    if not v.within_slo:
        notes.append("over SLO" if v.errors_ok else "errors")
    if v.queued:
        notes.append("engine queue")
    if v.disagreeing:
        notes.append(f"{v.disagreeing}/{v.runs} disagree")
    return ", ".join(notes) or "ok"


def _waiting(v: Verdict) -> str:
    """The engine's median queue at a level (``-``: the upstream exposes no such metric)."""
    return "-" if v.engine_waiting is None else f"{v.engine_waiting:g}"


def render_table(outcome: Outcome) -> str:
    header = (
        f"{'conc':>5} {'runs':>4} {'ok':>6} {'fail':>5} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'in-flight cost':>14} {'waiting':>7} "
        f"{'spread':>6}  verdict"
    )
    lines = [header]
    for v in outcome.knee.verdicts:
        steps = outcome.runs[v.concurrency]
        lines.append(
            f"{v.concurrency:>5} {v.runs:>4} {sum(s.requests for s in steps):>6} "
            f"{sum(s.errors for s in steps):>5} {_median(steps, 'throughput'):>7.2f} "
            f"{_median(steps, 'output_tokens_per_s'):>8.0f} {_median(steps, 'ttft_p50'):>8.3f}s "
            f"{v.ttft_p99:>8.3f}s {_median(steps, 'itl_p50') * 1000:>7.1f}ms {v.tpot_p99 * 1000:>7.1f}ms "
            f"{_median(steps, 'inflight_cost'):>14.0f} {_waiting(v):>7} {v.spread:>6.0%}  "
            f"{_notes(outcome, v)}"
        )
    return "\n".join(lines)


def _counted(steps: Sequence[StepStats]) -> str:
    """What the upstream's usage reported, against the words asked for."""
    measured = [s for s in steps if s.requests]
    if not measured or not any(s.mean_prompt_tokens for s in measured):
        return ""
    weight = sum(s.requests for s in measured)
    prompt = sum(s.mean_prompt_tokens * s.requests for s in measured) / weight
    output = sum(s.mean_output_tokens * s.requests for s in measured) / weight
    return f" ({prompt:.0f} prompt / {output:.0f} answer tokens on average by the upstream's count)"


def render_text(outcome: Outcome) -> str:
    cfg = outcome.config
    tpot = "off" if cfg.tpot_slo is None else f"{cfg.tpot_slo * 1000:g} ms"
    lines = [
        f"upstream {outcome.upstream}, model {outcome.model!r}, SLO p99 TTFT {cfg.ttft_slo:g} s, "
        f"p99 TPOT {tpot}; {cfg.describe_mix()}{_counted(outcome.steps)}",
        "",
        render_table(outcome),
        "",
        f"ramp: {outcome.stopped} ({len(outcome.steps)} measurements, {duration_text(outcome.seconds)} "
        "with the probe)",
        f"knee: {outcome.knee.reason}",
    ]
    verdicts = outcome.knee.verdicts
    if queue_waived(verdicts):
        lines.append(
            f"engine: requests waited inside it already at concurrency {verdicts[0].concurrency}, the "
            "lowest level measured (another client's traffic?): its queue was held against no level"
        )
    command = serve_command(outcome)
    rec = outcome.recommendation
    knee = outcome.knee
    if command is not None and rec is not None and knee.level is not None:
        v = knee.verdict(knee.level)
        assert v is not None
        steps = outcome.runs[knee.level]
        batch = ""
        if rec.batch_max_queue_wait is not None:
            batch = f"; batch is held up to {rec.batch_max_queue_wait:g} s, behind interactive"
        if rec.retry_after_max is not None:
            batch += f", and no caller is told to wait more than {rec.retry_after_max:g} s"
        if rec.max_inflight_tokens is not None:
            per_slot = ""
            if outcome.slot_cost is not None:
                c = outcome.slot_cost
                per_slot = f", a slot {c.mean:.0f} +- {c.sd:.0f} over {c.requests} requests"
            batch += (
                f"; cost budget {rec.max_inflight_tokens} tokens in flight (per request its prompt + "
                f"the 90th percentile of the answers, as the shim counts: what {knee.level} slots of the "
                f"mix hold 95 % of the time{per_slot}; in the knee's windows mean "
                f"{_median(steps, 'inflight_cost'):.0f}, 95 % {_median(steps, 'inflight_cost_high'):.0f})"
            )
        lines += [
            "",
            f"recommended: at most {rec.max_concurrency} in flight "
            f"({_median(steps, 'output_tokens_per_s'):.0f} tok/s, {_median(steps, 'throughput'):.2f} req/s, "
            f"p99 TTFT {v.ttft_p99:.3f} s there; the best level within the SLO did "
            f"{knee.best_throughput:.0f}); chat waits in the shim up to {rec.max_queue_wait:g} s, what "
            f"the {INTERACTIVE_BUDGET:g} s chat callers give a call to start leaves after that TTFT, "
            f"each class's queue what the engine drains within its wait{batch}",
            f"confidence: {knee.confidence} ({outcome.confidence_reason})",
            "",
            f"  {command}",
        ]
    else:
        lines += ["", "no recommendation: " + knee.reason]
    if outcome.png is not None:
        lines += ["", f"curves: {outcome.png}"]
    return "\n".join(lines)


def to_json(outcome: Outcome) -> dict[str, Any]:
    cfg = outcome.config
    knee = outcome.knee
    steps = []
    for step in outcome.steps:
        row: dict[str, Any] = asdict(step)
        row["first_error"] = outcome.first_errors.get(step.concurrency)
        steps.append(row)
    levels = [
        {
            **asdict(v),
            "output_tokens_per_s": _median(outcome.runs[v.concurrency], "output_tokens_per_s"),
            "requests_per_s": _median(outcome.runs[v.concurrency], "throughput"),
            "inflight_cost": _median(outcome.runs[v.concurrency], "inflight_cost"),
            "inflight_cost_high": _median(outcome.runs[v.concurrency], "inflight_cost_high"),
        }
        for v in knee.verdicts
    ]
    rec = outcome.recommendation
    at_knee = None
    if knee.level is not None:
        runs = outcome.runs[knee.level]
        at_knee = {
            "concurrency": knee.level,
            "limit": knee.limit,
            "output_tokens_per_s": _median(runs, "output_tokens_per_s"),
            "requests_per_s": _median(runs, "throughput"),
            "inflight_cost": _median(runs, "inflight_cost"),
            "inflight_cost_high": _median(runs, "inflight_cost_high"),
            "slot_cost": None if outcome.slot_cost is None else asdict(outcome.slot_cost),
            "best_in_slo": knee.best_throughput,
        }
    return {
        "upstream": outcome.upstream,
        "model": outcome.model,
        "ttft_slo": cfg.ttft_slo,
        "tpot_slo": cfg.tpot_slo,
        "prompt_words": str(cfg.prompt_words),
        "output_tokens": str(cfg.output_tokens),
        "levels_planned": list(cfg.levels),
        "long_share": cfg.long_share,
        "long_prompt_words": str(cfg.long_prompt_words),
        "step_seconds": cfg.step_seconds,
        "step_requests": cfg.step_requests,
        "max_seconds": cfg.max_seconds,
        "seconds": outcome.seconds,
        "probe": None
        if outcome.probe is None
        else {
            "ok": outcome.probe.ok,
            "seconds": outcome.probe.end - outcome.probe.start,
            "output_tokens": outcome.probe.output_tokens,
            "prompt_tokens": outcome.probe.prompt_tokens,
        },
        "plan": None
        if outcome.plan is None
        else {
            "levels": list(outcome.plan.levels),
            "repeats": outcome.plan.repeats,
            "sizing": asdict(outcome.plan.sizing),
            "request_seconds": outcome.plan.duration,
            "estimated_seconds": outcome.plan.seconds,
            "full_seconds": outcome.plan.full_seconds,
            "cuts": list(outcome.plan.cuts),
            "fits": outcome.plan.fits,
        },
        "seed": cfg.seed,
        "steps": steps,
        "levels": levels,
        "stopped": outcome.stopped,
        "knee": at_knee,
        "reason": knee.reason,
        "confidence": knee.confidence if knee.level is not None else None,
        "confidence_reason": outcome.confidence_reason,
        "confidence_within_run": None if outcome.own_confidence is None else outcome.own_confidence[0],
        "confidence_within_run_reason": None if outcome.own_confidence is None else outcome.own_confidence[1],
        "previous_run": None if outcome.previous_run is None else asdict(outcome.previous_run),
        "recommendation": None if rec is None else {**asdict(rec), "command": serve_command(outcome)},
        "png": None if outcome.png is None else str(outcome.png),
    }


def plot(outcome: Outcome, path: Path) -> Path:
    """Throughput, TTFT and TPOT against concurrency (each measurement and the medians), SLOs, knee.

    :class:`~llm_backoff_shim.lab.extra.MissingLabExtraError` without matplotlib (the ``lab`` extra)."""
    require_plotting(f"the plot {path.name}")
    # Figure without pyplot: no global figure registry, no GUI backend, safe off the main thread.
    from matplotlib.figure import Figure

    verdicts = outcome.knee.verdicts
    xs = [v.concurrency for v in verdicts]
    fig = Figure(figsize=(8, 9), dpi=100, layout="constrained")
    ax_x, ax_ttft, ax_tpot = fig.subplots(3, 1, sharex=True)
    every = outcome.steps
    ax_x.scatter([s.concurrency for s in every], [rate(s) for s in every], s=12, color="tab:blue", alpha=0.4)
    ax_x.plot(xs, [v.throughput for v in verdicts], "o-", color="tab:blue", label="median")
    ax_x.set_ylabel("throughput (answer tok/s)")
    ax_ttft.scatter(
        [s.concurrency for s in every], [s.ttft_p99 for s in every], s=12, color="tab:red", alpha=0.4
    )
    ax_ttft.plot(xs, [v.ttft_p99 for v in verdicts], "s-", color="tab:red", label="TTFT p99 (median)")
    ax_ttft.axhline(outcome.config.ttft_slo, color="tab:red", linestyle=":", label="SLO")
    ax_ttft.set_ylabel("TTFT (s)")
    ax_ttft.legend(loc="upper left")
    ax_tpot.scatter(
        [s.concurrency for s in every], [s.itl_p99 * 1000 for s in every], s=12, color="tab:orange", alpha=0.4
    )
    ax_tpot.plot(
        xs, [v.tpot_p99 * 1000 for v in verdicts], "s-", color="tab:orange", label="TPOT p99 (median)"
    )
    if outcome.config.tpot_slo is not None:
        ax_tpot.axhline(outcome.config.tpot_slo * 1000, color="tab:orange", linestyle=":", label="SLO")
    ax_tpot.set_ylabel("time per output token (ms)")
    ax_tpot.set_xlabel("concurrency (closed-loop workers)")
    ax_tpot.legend(loc="upper left")
    if len(xs) > 1:
        ax_tpot.set_xscale("log", base=2)
    ax_tpot.set_xticks(xs, [str(x) for x in xs])
    knee = outcome.knee
    if knee.level is not None:
        for ax in (ax_x, ax_ttft, ax_tpot):
            ax.axvline(knee.level, color="black", linestyle="--", linewidth=1)
        v = knee.verdict(knee.level)
        ax_x.annotate(
            f"knee: {knee.level} ({knee.confidence} confidence)",
            xy=(knee.level, v.throughput if v else 0.0),
            xytext=(6, -14),
            textcoords="offset points",
        )
    for ax in (ax_x, ax_ttft, ax_tpot):
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"{outcome.model} @ {outcome.upstream}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
