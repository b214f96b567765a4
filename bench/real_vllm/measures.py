"""Figures of one load run against a real engine that the shared report leaves out (pure).

- **idle slot-time while a caller could be served**: from the engine's sampled
  ``vllm:num_requests_running`` and the calls alive at each sample (started, not yet
  ended: waiting in a queue, sleeping before a retry, or running). At each sample the
  idle slots that a live caller not running could have used are
  ``min(slots - running, alive - running)``; summed over time and divided by the
  slot-time of the run (slots x the time from the first arrival to the last call's end);
  **where those callers were** splits it by the shim's sampled state (a caller that
  could have used an idle slot is counted first as admitted by the shim but not yet
  running in the engine, then as queued in the shim, else as between attempts: asleep on a
  hint, or on its way), which says whether the shim's admission or the callers' promises
  left the slot empty;
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


@dataclass(frozen=True)
class IdleSpan:
    """One sampled span of a run: ``idle`` slots a live caller not running could have used."""

    sample: Sample
    seconds: float
    idle: int


def _idle_spans(result: RunResult, slots: int) -> tuple[list[IdleSpan], float] | None:
    """The run's idle spans and its slot-time denominator (module doc), None without data."""
    samples = _running_samples(result)
    ends = [c.end for c in result.calls if c.end is not None]
    if len(samples) < 2 or not ends:
        return None
    window_end = max(ends)
    starts = sorted(c.start for c in result.calls)
    finished = sorted(ends)
    spans = []
    for current, following in itertools.pairwise(samples):
        if current.t >= window_end:
            break
        dt = min(following.t, window_end) - current.t
        dt = min(dt, MAX_SAMPLE_GAP)
        alive = bisect.bisect_right(starts, current.t) - bisect.bisect_right(finished, current.t)
        running = current.engine_running or 0
        spans.append(IdleSpan(current, dt, max(0, min(slots - running, alive - running))))
    window = window_end - min(starts)
    return (spans, slots * window) if window > 0 else None


def idle_slot_share(result: RunResult, slots: int) -> float | None:
    """Share of the run's slot-time idle while a live caller was not running (module doc)."""
    walked = _idle_spans(result, slots)
    if walked is None:
        return None
    spans, slot_time = walked
    return sum(span.idle * span.seconds for span in spans) / slot_time


#: Where a caller that could have used an idle slot was, in the order they are counted.
IDLE_PLACES = ("admitted, not running", "queued in the shim", "between attempts")


def idle_places(result: RunResult, slots: int) -> dict[str, float] | None:
    """:func:`idle_slot_share` split by where the callers were (module doc); the shares sum
    to it. None without the shim's sampled state (a run straight at the engine)."""
    walked = _idle_spans(result, slots)
    if walked is None:
        return None
    spans, slot_time = walked
    if any(s.sample.proxy_in_flight is None or s.sample.proxy_queued is None for s in spans if s.idle):
        return None
    shares = dict.fromkeys(IDLE_PLACES, 0.0)
    for span in spans:
        running = span.sample.engine_running or 0
        admitted = min(span.idle, max(0, (span.sample.proxy_in_flight or 0) - running))
        queued = min(span.idle - admitted, span.sample.proxy_queued or 0)
        for place, idle in zip(IDLE_PLACES, (admitted, queued, span.idle - admitted - queued), strict=True):
            shares[place] += idle * span.seconds / slot_time
    return shares


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
    idle_places: dict[str, float] | None = None

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
            idle_places=idle_places(result, slots),
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


def idle_rows(labels: Sequence[str], cells: Sequence[Cell]) -> list[list[str]]:
    """Per configuration with the shim's state sampled: the median share of slot-time idle
    while its callers were in each of :data:`IDLE_PLACES`, the seeds' values after it."""
    rows = []
    for label in labels:
        mine = sorted((c for c in cells if c.label == label and c.idle_places), key=lambda c: c.seed)
        if not mine:
            continue
        row = [label]
        for place in IDLE_PLACES:
            values = [(c.idle_places or {})[place] for c in mine]
            each = " / ".join(show(v, "share") for v in values)
            row.append(show(median(values), "share") + (f" ({each})" if len(values) > 1 else ""))
        rows.append(row)
    return rows


def idle_markdown(labels: Sequence[str], cells: Sequence[Cell]) -> str:
    """Where the callers were while a slot stood idle, as a Markdown table ("" if nowhere known)."""
    rows = idle_rows(labels, cells)
    if not rows:
        return ""
    header = ["slot-time idle, caller waiting, while the caller was", *IDLE_PLACES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def text_table(labels: Sequence[str], cells: Sequence[Cell]) -> str:
    """The figures of :func:`markdown_table` for a terminal: a block per configuration."""
    width = max(len(title) for _a, title, _k in COLUMNS) + 2
    out = []
    for row in summary_rows(labels, cells):
        out.append(row[0])
        out += [f"  {title:<{width}}{value}" for (_a, title, _k), value in zip(COLUMNS, row[1:], strict=True)]
    return "\n".join(out)
