"""Figures of one load run against a real engine that the shared report leaves out (pure).

- **idle slot-time while a caller could be served**: from the engine's sampled
  ``vllm:num_requests_running`` and the calls alive at each sample (started, not yet
  ended: waiting in a queue, sleeping before a retry, or running). At each sample the
  idle slots that a live caller not running could have used are
  ``min(slots - running, alive - running)``; summed over time and divided by the
  slot-time of the run (slots x the time from the first arrival to the last call's end);
- **engine pace**: the answer tokens vLLM generated in the run over its busy slot-time (the
  sampled ``vllm:num_requests_running`` summed over time), times the slots: the answer
  tokens/s it would make with every slot busy at the pace it had in this run, beside the
  capacity measured before the arms (a shared machine's engine speeds up and slows down
  between runs, so a cell's gap to the oracle may be the engine's, not the arm's);
- **how interactive calls failed**: refused at once, after retries, after a queue wait, or
  at the caller's own deadline, each with its p90 time to failure.
"""

from __future__ import annotations

import bisect
import itertools

from llm_backoff_shim.lab.figures import percentile
from llm_backoff_shim.lab.load_records import RunResult

#: A gap between samples longer than this counts only this long (a stalled sampler is no evidence).
MAX_SAMPLE_GAP = 1.0


def idle_slot_share(result: RunResult, slots: int) -> float | None:
    """Share of the run's slot-time idle while a live caller was not running (module doc)."""
    samples = [s for s in result.samples if s.engine_running is not None]
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
    samples = [s for s in result.samples if s.engine_running is not None]
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
