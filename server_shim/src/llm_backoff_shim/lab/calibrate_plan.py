"""How long calibrate measures each level, and how long the sweep will take (pure).

A level is sized by the engine's own request duration, not by a number of seconds:

- **Ramp-in.** When the concurrency changes, the level first waits for as many requests
  to end as it has workers (one turnover: every slot's request, on average, was replaced
  by one started at this level, about one request's duration). The requests carried in
  from the level before and the burst that new workers start together end inside it.
- **Window.** Then it counts :meth:`Sizing.completions` completions: two per slot, at
  least 20, but never more than six request durations' worth (at concurrency 1, six
  requests). Two per slot: every slot turned over twice inside the window, so the lengths
  in flight are the mix's steady ones and a request that outlasts the others still ends
  inside it. At least 20: the p99 TTFT of 20 requests lies between the two slowest, and
  the answer tokens/s over the window (counted token by token) varies by a few percent
  between repeats. At most six durations: low levels, which rarely hold the knee, would
  otherwise cost 20 durations each on a slow engine. The window also lasts at least
  ``min_seconds`` (``--step-seconds``): a machine's hiccup of a few hundred
  milliseconds should not be a tenth of a fast engine's window. At most ``cap``
  (``--step-requests``) completions.

A measurement therefore takes ``1 + completions / level`` request durations (the ramp-in
only when the level changed). The sweep's plan (:func:`plan_sweep`) estimates the whole
run at the duration a probe measured at concurrency 1 and, when it does not fit in
``--max-seconds``, cuts in this order: coarser steps (:data:`COARSE`: one per slot, at
least 10, at most three durations), then fewer repeats (two per level), then fewer levels
(every other level of the ramp; the refinement between two levels narrows the knee
afterwards). Requests slow down as the batch fills, so the estimate is a floor; the
ramp re-estimates each measurement from the durations measured so far
(:func:`measurement_seconds`) and stops, saying so, when the next one does not fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .knee import StepStats


def settle_measurements(repeats: int) -> int:
    """Measurements beyond the climb a typical run takes to settle: one refinement between
    the knee and a level over the SLO, the level above the knee measured once more and the
    knee itself up to ``repeats`` times."""
    return repeats + 1


@dataclass(frozen=True)
class Sizing:
    """How many completions a level's window counts (see the module doc)."""

    per_slot: int = 2
    minimum: int = 20
    max_durations: float = 6.0
    cap: int = 1000
    min_seconds: float = 3.0

    def __post_init__(self) -> None:
        if self.per_slot < 1 or self.minimum < 1 or self.cap < 1:
            raise ValueError(f"per_slot, minimum and cap must be >= 1, got {self}")
        if not (math.isfinite(self.max_durations) and self.max_durations >= 1):
            raise ValueError(f"max_durations must be >= 1, got {self.max_durations!r}")
        if not (math.isfinite(self.min_seconds) and self.min_seconds >= 0):
            raise ValueError(f"min_seconds must be >= 0, got {self.min_seconds!r}")

    def completions(self, level: int) -> int:
        """Completions the window of ``level`` counts."""
        wanted = max(self.per_slot * level, self.minimum)
        wanted = min(wanted, math.floor(self.max_durations * level))
        return max(1, min(wanted, self.cap))

    def window_durations(self, level: int) -> float:
        """The window's length in request durations: ``level`` requests end per duration."""
        return self.completions(level) / level

    def describe(self) -> str:
        return (
            f"{self.per_slot} completions per slot, at least {self.minimum}, at most "
            f"{self.max_durations:g} request durations and {self.cap} completions, at least "
            f"{self.min_seconds:g} s"
        )


def coarse(sizing: Sizing) -> Sizing:
    """The coarser steps a plan falls back to when the full one does not fit (module doc)."""
    return replace(
        sizing,
        per_slot=1,
        minimum=max(1, min(sizing.minimum, 10)),
        max_durations=min(sizing.max_durations, 3.0),
    )


COARSE = coarse(Sizing())


def measurement_seconds(sizing: Sizing, level: int, duration: float, *, turnover: bool = True) -> float:
    """Seconds one measurement of ``level`` takes when a request lasts ``duration`` s there."""
    window = max(sizing.min_seconds, sizing.window_durations(level) * duration)
    return (duration if turnover else 0.0) + window


def sweep_seconds(levels: Sequence[int], sizing: Sizing, duration: float, settle: int) -> float:
    """A sweep climbing every level of ``levels`` then taking ``settle`` more measurements
    (each at the cost of the top level), at ``duration`` s per request."""
    climb = sum(measurement_seconds(sizing, level, duration) for level in levels)
    top = measurement_seconds(sizing, levels[-1], duration) if levels else 0.0
    return climb + settle * top


def thin(levels: Sequence[int]) -> tuple[int, ...]:
    """Every other level of a ramp, keeping its first and last: 1,2,4,8,16 -> 1,4,16."""
    kept = list(levels[::2])
    if levels and kept[-1] != levels[-1]:
        kept.append(levels[-1])
    return tuple(kept)


@dataclass(frozen=True)
class SweepPlan:
    """The sweep calibrate will run: its levels, repeats and sizing, its estimated length,
    and what was cut to fit ``--max-seconds`` (``fits`` False: even cut, it may not)."""

    levels: tuple[int, ...]
    repeats: int
    sizing: Sizing
    duration: float
    seconds: float
    full_seconds: float
    max_seconds: float
    cuts: tuple[str, ...] = ()
    fits: bool = True


def plan_sweep(
    levels: Sequence[int], repeats: int, sizing: Sizing, duration: float, max_seconds: float
) -> SweepPlan:
    """The plan for a sweep whose requests last ``duration`` s (the probe's), cut to fit
    ``max_seconds`` in the order of the module doc."""
    if not levels:
        raise ValueError("no level to plan")
    if not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"duration must be a positive number of seconds, got {duration!r}")

    ramp = tuple(levels)
    full = sweep_seconds(ramp, sizing, duration, settle_measurements(repeats))
    cuts: list[str] = []
    reps = repeats

    def cost() -> float:
        return sweep_seconds(ramp, sizing, duration, settle_measurements(reps))

    if cost() > max_seconds and coarse(sizing) != sizing:
        sizing = coarse(sizing)
        cuts.append(f"coarser steps ({sizing.describe()})")
    if cost() > max_seconds and reps > 2:
        reps = 2
        cuts.append("2 measurements per level next to the knee")
    if cost() > max_seconds and len(ramp) > 2:
        while cost() > max_seconds and len(thin(ramp)) < len(ramp):
            ramp = thin(ramp)
        cuts.append(f"fewer levels ({','.join(map(str, ramp))})")
    seconds = cost()
    return SweepPlan(
        levels=ramp,
        repeats=reps,
        sizing=sizing,
        duration=duration,
        seconds=seconds,
        full_seconds=full,
        max_seconds=max_seconds,
        cuts=tuple(cuts),
        fits=seconds <= max_seconds,
    )


def duration_text(seconds: float) -> str:
    """``"45 s"``, ``"10 min"``, ``"2.5 h"``: a length of time for people."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f}".removesuffix(".0") + " min"
    return f"{seconds / 3600:.1f}".removesuffix(".0") + " h"


def plan_lines(plan: SweepPlan, probe: str) -> list[str]:
    """What calibrate prints once the probe has measured a request, before the sweep."""
    lines = [
        f"plan: {probe}; each level waits for one request per slot to end (ramp-in), then counts "
        f"{plan.sizing.describe()}",
        f"plan: levels {','.join(map(str, plan.levels))}, then up to {plan.repeats} measurements of the "
        f"levels next to the knee: about {duration_text(plan.seconds)} at the probe's pace if it climbs "
        "to the top (it stops at the knee; requests slow as the batch fills, and each level re-estimates)",
    ]
    if plan.cuts:
        lines.append(
            f"plan: the full sweep would take about {duration_text(plan.full_seconds)}, over the "
            f"{duration_text(plan.max_seconds)} --max-seconds leaves: cut to " + "; ".join(plan.cuts)
        )
    if not plan.fits:
        lines.append(
            f"plan: still over the {duration_text(plan.max_seconds)} --max-seconds leaves: the sweep stops "
            "when the next measurement does not fit, and recommends from what it measured"
        )
    elif not plan.cuts:
        lines.append(f"plan: within the {duration_text(plan.max_seconds)} --max-seconds leaves")
    return lines


def expected_duration(
    level: int, probe: float, runs: Mapping[int, Sequence[StepStats]], *, full: bool = True
) -> float:
    """How long a request will take at ``level``: the mean latency measured at the highest
    level at or below it (the probe's before any) and, with ``full``, no less than ``level``
    over the best rate measured so far (Little's law: were the engine already full, requests
    would queue in it)."""
    below = [lvl for lvl in runs if lvl <= level and any(s.mean_latency > 0 for s in runs[lvl])]
    latency = probe
    if below:
        latency = max(s.mean_latency for s in runs[max(below)])
    best = max((s.throughput for steps in runs.values() for s in steps), default=0.0)
    if full and best > 0:
        latency = max(latency, level / best)
    return latency


def time_to_go(
    levels: Sequence[int],
    repeats: int,
    sizing: Sizing,
    probe: float,
    runs: Mapping[int, Sequence[StepStats]],
    settled: int | None = None,
    *,
    full: bool = True,
) -> float:
    """Seconds the rest of a sweep takes, each request lasting as :func:`expected_duration`
    says from what was measured (``full``: as if the engine were already full, the most it
    can take; else at the pace of the highest level measured): while climbing (``settled``
    None), every level not yet measured and then the settling; once the climb is over, the
    settling measurements not yet taken (``settled`` of them were), at the cost of the
    highest level measured."""
    top = max(runs, default=0)
    ahead = [level for level in levels if level > top] if settled is None else []

    def cost(level: int) -> float:
        return measurement_seconds(sizing, level, expected_duration(level, probe, runs, full=full))

    seconds = sum(cost(level) for level in ahead)
    last = ahead[-1] if ahead else top
    each = cost(last) if last else 0.0
    return seconds + max(0, settle_measurements(repeats) - (settled or 0)) * each
