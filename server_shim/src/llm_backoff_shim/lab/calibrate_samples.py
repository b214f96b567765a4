"""Calibrate's measurements (pure): one request as the client saw it, one level's statistics
from its steady window.

Percentiles interpolate linearly between ranks, as numpy's default does, with the stdlib
alone: calibrate runs where only the shim is installed (its PNG aside).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .knee import StepStats


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it. Times are clock readings, seconds.

    ``first_token`` is None for a failed request or an answer without content;
    ``itl`` is the request's mean gap between tokens after the first (None below two);
    ``token_times`` the arrival of each chunk that carried answer text; ``cost`` what the
    shim's cost cap counts for it (:mod:`~llm_backoff_shim.lab.calibrate_cost`). ``done``
    False: a request still running when its level's window closed, ``end`` that moment.
    """

    worker: int
    seq: int
    start: float
    end: float
    ok: bool
    first_token: float | None = None
    itl: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    cost: int = 0
    token_times: tuple[float, ...] = ()
    done: bool = True


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method: between the two nearest ranks of
    ``(n - 1) * q / 100``); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(float(v) for v in values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tokens_in(sample: Sample, low: float, high: float) -> float:
    """Answer tokens of ``sample`` that arrived in ``(low, high]``.

    Each streamed chunk's arrival time is kept; when the upstream's ``usage`` counted
    more tokens than chunks (several tokens per chunk), each chunk weighs its share.
    """
    times = sample.token_times
    if not times:
        return 0.0
    weight = sample.output_tokens / len(times) if sample.done and sample.output_tokens > len(times) else 1.0
    return weight * sum(1 for t in times if low < t <= high)


def _overlap(sample: Sample, low: float, high: float) -> float:
    return max(0.0, min(sample.end, high) - max(sample.start, low))


#: The share of the window's time a budget sized from it holds the cost in flight
#: (:attr:`StepStats.inflight_cost_high`).
COST_QUANTILE = 0.95


def cost_quantile(samples: Sequence[Sample], low: float, high: float, q: float = COST_QUANTILE) -> float:
    """The cost in flight that the requests in ``samples`` stayed at or below for ``q`` of the
    window ``(low, high]``'s time (0 for an empty window)."""
    steps: dict[float, int] = {}
    for s in samples:
        start, end = max(s.start, low), min(s.end, high)
        if end > start and s.cost:
            steps[start] = steps.get(start, 0) + s.cost
            steps[end] = steps.get(end, 0) - s.cost
    if high <= low or not steps:
        return 0.0
    level, at, spans = 0, low, []
    for t in sorted(steps):
        spans.append((level, t - at))
        level, at = level + steps[t], t
    spans.append((level, high - at))
    spans.sort()
    covered, need = 0.0, q * (high - low)
    for cost, seconds in spans:
        covered += seconds
        if covered >= need:
            return float(cost)
    return float(spans[-1][0])


def summarize(
    concurrency: int, samples: Sequence[Sample], *, level_start: float, window: tuple[float, float]
) -> StepStats:
    """The statistics of one level from its steady window ``(low, high]`` (clock readings).

    ``samples`` holds every request that overlaps the window: finished ones, and the ones
    still running when it closed (``done`` False, ``end`` the closing time). The window
    opens once the level has turned over (see :mod:`llm_backoff_shim.lab.calibrate_loop`),
    so its ramp-in (requests carried in from the level before, the burst of new workers)
    is not in it.

    - Throughput counts what happened inside the window: requests/s is the requests that
      *ended* in it over its length; answer tokens/s the tokens that *arrived* in it,
      running requests' included. Neither depends on how long a request is compared with
      the window, so a level where a request outlasts the window is measured as well as
      one of short requests.
    - Latency figures (TTFT, TPOT, latency) are of the requests that ended in the window
      and started at this level, leaving out each worker's first request (its start is the
      burst that opens a level); with none such, of every request that ended in it.
    - ``inflight_cost``: the time-weighted mean of the in-flight requests' cost
      (as the shim prices it, :mod:`~llm_backoff_shim.lab.calibrate_cost`) over the window;
      ``inflight_cost_high``: the cost they stayed at or below for 95 % of it
      (:func:`cost_quantile`).
    """
    low, high = window
    length = high - low
    ended = [s for s in samples if s.done and low < s.end <= high]
    errors = sum(1 for s in ended if not s.ok)
    ok = [s for s in ended if s.ok]
    if length <= 0 or not ok:
        return StepStats(
            concurrency, 0, errors, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, window=max(0.0, length)
        )
    judged = [s for s in ok if s.start >= level_start and s.seq > 0] or ok
    latencies = [s.end - s.start for s in judged]
    ttfts = [(s.first_token if s.first_token is not None else s.end) - s.start for s in judged]
    itls = [s.itl for s in judged if s.itl is not None]
    tokens = sum(tokens_in(s, low, high) for s in samples if s.ok or not s.done)
    cost = sum(s.cost * _overlap(s, low, high) for s in samples) / length
    return StepStats(
        concurrency=concurrency,
        requests=len(ok),
        errors=errors,
        throughput=len(ok) / length,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        latency_p50=percentile(latencies, 50),
        latency_p99=percentile(latencies, 99),
        output_tokens_per_s=tokens / length,
        mean_prompt_tokens=statistics.fmean([s.prompt_tokens for s in ok]),
        mean_output_tokens=statistics.fmean([s.output_tokens for s in ok]),
        ttft_p90=percentile(ttfts, 90),
        latency_p90=percentile(latencies, 90),
        mean_latency=statistics.fmean([s.end - s.start for s in ok]),
        inflight_cost=cost,
        inflight_cost_high=cost_quantile(samples, low, high),
        window=length,
    )
