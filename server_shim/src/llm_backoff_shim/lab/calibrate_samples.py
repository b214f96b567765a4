"""Calibrate's measurements (pure): one request as the client saw it, one level's statistics.

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
    ``itl`` is the request's mean gap between tokens after the first (None below two).
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


def steady_samples(samples: Sequence[Sample]) -> list[Sample]:
    """Successful samples without each worker's first request (warm-up), unless that leaves none.

    The first wave starts all at once, before the engine's batch has settled; later
    requests start whenever one ends, which is the steady state being measured.
    """
    ok = [s for s in samples if s.ok]
    steady = [s for s in ok if s.seq > 0]
    return steady or ok


def summarize(concurrency: int, samples: Sequence[Sample]) -> StepStats:
    """The statistics of one level.

    Throughput is ``concurrency / mean latency``: Little's law for a closed loop with no
    think time, where every worker always has one request outstanding. Unlike counting
    completions in a window it needs no window and stays accurate when a step holds only
    a few long requests. Failed requests are left out of it, which overstates a level
    with many fast failures; such a level is past the knee by its error share anyway.
    """
    used = steady_samples(samples)
    errors = sum(1 for s in samples if not s.ok)
    if not used:
        return StepStats(concurrency, 0, errors, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    latencies = [s.end - s.start for s in used]
    ttfts = [(s.first_token if s.first_token is not None else s.end) - s.start for s in used]
    itls = [s.itl for s in used if s.itl is not None]
    mean_latency = statistics.fmean(latencies)
    throughput = concurrency / mean_latency if mean_latency > 0 else 0.0
    mean_output = statistics.fmean([s.output_tokens for s in used])
    return StepStats(
        concurrency=concurrency,
        requests=len(used),
        errors=errors,
        throughput=throughput,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        latency_p50=percentile(latencies, 50),
        latency_p99=percentile(latencies, 99),
        output_tokens_per_s=throughput * mean_output,
        mean_prompt_tokens=statistics.fmean([s.prompt_tokens for s in used]),
        mean_output_tokens=mean_output,
        ttft_p90=percentile(ttfts, 90),
        latency_p90=percentile(latencies, 90),
    )
