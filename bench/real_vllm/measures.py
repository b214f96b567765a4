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
from dataclasses import dataclass

from llm_backoff_shim.lab.figures import percentile
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
