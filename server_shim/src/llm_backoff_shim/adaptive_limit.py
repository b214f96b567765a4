"""An adaptive concurrency limit: Netflix's Gradient2, driven by time to first byte.

The fixed ``--max-concurrency`` is a guess about the engine's knee: below it the
engine's batch has room and latency is flat; above it requests wait inside the engine
and time to first byte climbs. :class:`GradientLimit` finds the knee from latency
alone (as Envoy's adaptive concurrency filter and Netflix's concurrency-limits do),
one tiny state update per sample:

    long  = slow EWMA of TTFB (the "no queueing" baseline)
    short = this sample
    gradient = clamp(tolerance * long / short, 0.5, 1.0)   # < 1 once latency rises
    target   = limit * gradient + sqrt(limit)              # sqrt: headroom to probe upward
    limit    = limit * (1 - smoothing) + target * smoothing, clamped to [min, max]

Latency at the baseline lets the limit grow by about ``smoothing * sqrt(limit)`` per
sample; latency ``tolerance`` times the baseline or more pulls it down. Two
guards from Gradient2: when the baseline has drifted far above current latency (load
fell), it decays toward it; and an under-used limit (fewer than half its slots in
flight) does not grow, since its samples say nothing about more load. An upstream
overload answer (vLLM's 503) cuts the limit by ``backoff`` at once.

The time to first byte is measured from admission (not arrival: queue time in the
shim is not engine latency) to the upstream's response headers. For a streamed
request that is the engine's time to first token; for a non-streamed one it is the
whole generation, which the baseline then reflects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GradientConfig:
    min_limit: int = 1
    max_limit: int = 64
    initial_limit: int | None = None
    tolerance: float = 1.5
    smoothing: float = 0.2
    long_window: int = 100
    backoff: float = 0.9

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError("need 1 <= min_limit <= max_limit")
        if self.initial_limit is not None and not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError("initial_limit must lie between min_limit and max_limit")
        if not self.tolerance >= 1:
            raise ValueError("tolerance must be >= 1")
        if not 0 < self.smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        if self.long_window < 1:
            raise ValueError("long_window must be >= 1")
        if not 0 < self.backoff < 1:
            raise ValueError("backoff must be in (0, 1)")


class GradientLimit:
    """A :class:`~llm_backoff_shim.limit.ConcurrencyLimit` that follows latency (module docstring)."""

    def __init__(self, config: GradientConfig) -> None:
        self.config = config
        start = config.initial_limit if config.initial_limit is not None else config.min_limit
        self._estimate = float(start)
        self._long: float | None = None
        self._samples = 0

    @property
    def limit(self) -> int:
        return max(self.config.min_limit, min(self.config.max_limit, int(self._estimate)))

    @property
    def estimate(self) -> float:
        return self._estimate

    @property
    def baseline(self) -> float | None:
        """The long-term TTFB average (None before the first sample)."""
        return self._long

    def on_sample(self, rtt: float, in_flight: int) -> None:
        """One time-to-first-byte measurement, taken with ``in_flight`` requests upstream."""
        if not (rtt > 0 and math.isfinite(rtt)):
            return
        cfg = self.config
        self._samples += 1
        if self._long is None:
            self._long = rtt
        else:
            # A plain mean while warming up, then an EWMA over about long_window samples.
            weight = 1.0 / min(self._samples, cfg.long_window)
            self._long += weight * (rtt - self._long)
            if self._long / rtt > 2.0:
                # Load fell and the baseline is stuck high: let it follow the present faster.
                self._long *= 0.95
        if in_flight < self._estimate / 2:
            return
        gradient = max(0.5, min(1.0, cfg.tolerance * self._long / rtt))
        target = self._estimate * gradient + math.sqrt(self._estimate)
        estimate = self._estimate * (1 - cfg.smoothing) + target * cfg.smoothing
        self._estimate = max(float(cfg.min_limit), min(float(cfg.max_limit), estimate))

    def on_complete(self, *, service_time: float, in_flight: int, overloaded: bool) -> None:
        if overloaded:
            self._estimate = max(float(self.config.min_limit), self._estimate * self.config.backoff)
