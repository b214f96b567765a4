"""Figures of one load run against a real engine that the shared report leaves out (pure).

- **idle slot-time while a caller could be served**: from the engine's sampled
  ``vllm:num_requests_running`` and the calls alive at each sample (started, not yet
  ended: waiting in a queue, sleeping before a retry, or running). At each sample the
  idle slots that a live caller not running could have used are
  ``min(slots - running, alive - running)``; summed over time and divided by the
  slot-time of the run (slots x the time from the first arrival to the last call's end);
- **useful tokens of full-load capacity**: useful tokens over the answer tokens/s of the
  engine with every slot busy (:mod:`.capacity`) times (arrival window + batch deadline);
  beside the report's ratio to calibrate's tokens/s at its knee;
- **engine tokens wasted**: the answer tokens vLLM generated over the run
  (``vllm:generation_tokens_total``) that no completed call received, as a share of
  all it generated (callers who left mid-answer, or whose deadline cut them);
- **interactive p90 time to failure**: over the interactive calls that failed;
- **engine pace**: the answer tokens vLLM generated in the run over its busy slot-time (the
  sampled ``vllm:num_requests_running`` summed over time), times the slots: the answer
  tokens/s it would make with every slot busy at the pace it had in this run. A shared
  machine's engine speeds up and slows down between runs (seen here: 760 answer tokens/s
  in one run, the same load served 10-20 % beyond that in the next); **useful of the run's
  pace** divides useful tokens by that pace times (arrival window + batch deadline), so
  cells run on a faster or slower engine can be set side by side.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llm_backoff_shim.lab.figures import Figures, percentile
from llm_backoff_shim.lab.load_records import RunResult, Sample

#: A gap between samples longer than this counts only this long (a stalled sampler is no evidence).
MAX_SAMPLE_GAP = 1.0


def _running_samples(result: RunResult) -> list[Sample]:
    """The samples that read the engine's running count, in time order."""
    return [s for s in result.samples if s.engine_running is not None]


def idle_slot_share(result: RunResult, slots: int) -> float | None:
    """Share of the run's slot-time idle while a live caller was not running (module doc)."""
    samples = _running_samples(result)
    ends = [c.end for c in result.calls if c.end is not None]
    if len(samples) < 2 or not ends:
        return None
    window_end = max(ends)
    starts = sorted(c.start for c in result.calls)
    finished = sorted(ends)
    idle = 0.0
    for current, following in itertools.pairwise(samples):
        if current.t >= window_end:
            break
        dt = min(following.t, window_end) - current.t
        dt = min(dt, MAX_SAMPLE_GAP)
        alive = bisect.bisect_right(starts, current.t) - bisect.bisect_right(finished, current.t)
        running = current.engine_running or 0
        idle += max(0, min(slots - running, alive - running)) * dt
    window = window_end - min(starts)
    return idle / (slots * window) if window > 0 else None


def engine_pace(result: RunResult, slots: int) -> float | None:
    """Answer tokens/s with every slot busy at this run's pace (module docstring)."""
    samples = _running_samples(result)
    generated = result.engine_stats.get("tokens_generated")
    if len(samples) < 2 or not generated:
        return None
    busy = sum(
        (current.engine_running or 0) * min(following.t - current.t, MAX_SAMPLE_GAP)
        for current, following in itertools.pairwise(samples)
    )
    return float(generated) * slots / busy if busy > 0 else None


def wasted_share(result: RunResult) -> float | None:
    generated = result.engine_stats.get("tokens_generated")
    wasted = result.engine_stats.get("aborted_tokens")
    if not generated or wasted is None:
        return None
    return float(wasted) / float(generated)


def interactive_failure_p90(result: RunResult) -> float | None:
    times = [
        c.duration for c in result.calls if c.cls == "interactive" and not c.ok and c.duration is not None
    ]
    return percentile(times, 90)


#: A refusal answered later than this came after a wait in the shim's queue, not at arrival.
QUEUED_REFUSAL = 0.5


def interactive_failure_paths(result: RunResult) -> dict[str, tuple[int, float | None]]:
    """How the interactive calls that failed ended, each path with its count and p90 time to
    failure: ``at once`` (refused on arrival, not retried), ``after retries`` (refused on
    arrival each time, more than one attempt), ``queued, then refused`` (an attempt turned away
    after more than :data:`QUEUED_REFUSAL` s in the shim's queue) and ``deadline`` (the caller's
    own timeout: waiting inside the engine, or its answer cut)."""
    paths: dict[str, list[float]] = {}
    for call in result.calls:
        if call.cls != "interactive" or call.ok or call.duration is None:
            continue
        if call.outcome == "deadline":
            path = "deadline"
        elif any(a.rejected and (a.latency or 0.0) > QUEUED_REFUSAL for a in call.attempts):
            path = "queued, then refused"
        elif len(call.attempts) > 1:
            path = "after retries"
        else:
            path = "at once"
        paths.setdefault(path, []).append(call.duration)
    return {path: (len(times), percentile(times, 90)) for path, times in sorted(paths.items())}


@dataclass(frozen=True)
class Cell:
    """One configuration on one seed: the headline figures, as numbers (None: not applicable)."""

    label: str
    seed: int
    calls: int
    interactive_calls: int
    interactive_within_budget: int
    interactive_ttft_p50: float | None
    batch_served: float | None
    useful_tokens: int
    useful_fraction: float | None
    useful_of_full_load: float | None
    engine_tokens_per_s: float | None
    useful_of_pace: float | None
    failed: int
    failed_fast_share: float | None
    failure_p90: float | None
    interactive_failure_p90: float | None
    wasted_share: float | None
    idle_share: float | None
    tokens_generated: int
    load_average: float

    @classmethod
    def of(
        cls, result: RunResult, figs: Figures, *, seed: int, slots: int, load: float, full_tokens_per_s: float
    ) -> Cell:
        scenario = result.scenario
        span = scenario.duration + scenario.deadline_of("batch")
        full_ceiling = full_tokens_per_s * span
        pace = engine_pace(result, slots)
        return cls(
            label=result.setup.label,
            seed=seed,
            calls=figs.calls,
            interactive_calls=figs.interactive_calls,
            interactive_within_budget=figs.interactive_within_budget,
            interactive_ttft_p50=figs.ttft_p50,
            batch_served=figs.batch_served,
            useful_tokens=figs.useful_tokens,
            useful_fraction=figs.useful_fraction,
            useful_of_full_load=figs.useful_tokens / full_ceiling if full_ceiling > 0 else None,
            engine_tokens_per_s=pace,
            useful_of_pace=None if pace is None else figs.useful_tokens / (pace * span),
            failed=figs.calls - figs.ok,
            failed_fast_share=figs.failed_fast_share,
            failure_p90=figs.failure_p90,
            interactive_failure_p90=interactive_failure_p90(result),
            wasted_share=wasted_share(result),
            idle_share=idle_slot_share(result, slots),
            tokens_generated=int(result.engine_stats.get("tokens_generated", 0)),
            load_average=load,
        )


def median(values: Iterable[float | int | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return statistics.median(present) if present else None


#: (attribute of Cell, column title, how to show one value)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("interactive_within_budget", "interactive within 5 s TTFT", "count"),
    ("batch_served", "batch served", "share"),
    ("useful_tokens", "useful tokens", "tokens"),
    ("useful_fraction", "of calibrate's capacity", "share"),
    ("useful_of_full_load", "of full-load capacity", "share"),
    ("engine_tokens_per_s", "engine pace, tokens/s", "rate"),
    ("useful_of_pace", "of the run's pace", "share"),
    ("failed_fast_share", "failures < 1 s", "share"),
    ("failure_p90", "p90 time to failure", "seconds"),
    ("interactive_failure_p90", "interactive p90 to failure", "seconds"),
    ("wasted_share", "engine tokens wasted", "share"),
    ("idle_share", "slot-time idle, caller waiting", "share"),
    ("interactive_ttft_p50", "interactive TTFT p50", "seconds"),
)


def show(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "share":
        return f"{value:.0%}" if value >= 0.1 or value == 0 else f"{value:.1%}"
    if kind == "seconds":
        return f"{value:.2f} s"
    if kind == "rate":
        return f"{value:.0f}"
    if kind == "tokens":
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}"


def summary_rows(labels: Sequence[str], cells: Sequence[Cell]) -> list[list[str]]:
    """Per configuration: the median over seeds of each column, the seeds' values after it."""
    rows = []
    for label in labels:
        mine = sorted((c for c in cells if c.label == label), key=lambda c: c.seed)
        row = [label]
        for attr, _title, kind in COLUMNS:
            values = [getattr(c, attr) for c in mine]
            shown = [show(v, kind) for v in values]
            if attr == "interactive_within_budget":
                shown = [f"{text}/{c.interactive_calls}" for text, c in zip(shown, mine, strict=True)]
            each = " / ".join(shown)
            row.append(
                show(median(values), kind) + (f" ({each})" if len(values) > 1 or kind == "count" else "")
            )
        rows.append(row)
    return rows


def markdown_table(labels: Sequence[str], cells: Sequence[Cell]) -> str:
    header = ["configuration", *[title for _a, title, _k in COLUMNS]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(labels, cells)]
    return "\n".join(lines)


def text_table(labels: Sequence[str], cells: Sequence[Cell]) -> str:
    """The figures of :func:`markdown_table` for a terminal: a block per configuration."""
    width = max(len(title) for _a, title, _k in COLUMNS) + 2
    out = []
    for row in summary_rows(labels, cells):
        out.append(row[0])
        out += [f"  {title:<{width}}{value}" for (_a, title, _k), value in zip(COLUMNS, row[1:], strict=True)]
    return "\n".join(out)
