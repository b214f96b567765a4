"""An adaptive concurrency limit driven by time to first byte (Envoy's gradient controller).

The fixed ``--max-concurrency`` is a guess about the engine's knee: below it the
engine's batch has room and time to first byte (TTFB) stays near its no-load value;
above it requests wait inside the engine and TTFB climbs. :class:`GradientLimit`
finds the knee from latency alone, as Envoy's adaptive concurrency filter does,
with two tiny state machines:

**Baseline (minRTT).** The no-load TTFB is measured, not assumed. From the start it
is the lowest sample seen (the limit starts at ``min_limit``, so the first samples
are taken without load); every ``probe_interval`` seconds the limit drops to
``min_limit`` until ``probe_samples`` requests have been measured at that concurrency,
and their median replaces it, so an engine that became slower is noticed too. (A
running average of all samples, as Netflix's Gradient2 keeps, would follow the
latency up under sustained load and let the limit creep past the knee; re-measuring
at low concurrency, as Envoy does, keeps the reference honest.)

**Gradient.** Every other sample moves the limit, smoothed like Gradient2::

    gradient = clamp((1 + buffer) * baseline / ttfb, 0.5, 2.0)   # < 1 once latency rises
    target   = limit * gradient + sqrt(limit)                    # sqrt: headroom to probe upward
    limit    = limit * (1 - smoothing) + target * smoothing, clamped to [min_limit, max_limit]

A limit that is not used (fewer than half its slots in flight) does not grow, since
its samples say nothing about more load. An upstream overload answer (vLLM's 503)
cuts the limit by ``backoff`` at once.

TTFB is measured from admission (not arrival: time queued in the shim is not engine
latency) to the first byte of the response *body* (vLLM sends a stream's headers at
once, even while the request waits in the engine): for a streamed request the engine's
time to first token, for a non-streamed one the whole generation, which the baseline
then reflects too. Pure: time comes from the injected clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(frozen=True)
class GradientConfig:
    min_limit: int = 1
    max_limit: int = 64
    buffer: float = 0.25
    smoothing: float = 0.2
    probe_interval: float = 60.0
    probe_samples: int = 5
    backoff: float = 0.9

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError("need 1 <= min_limit <= max_limit")
        if not self.buffer >= 0:
            raise ValueError("buffer must be >= 0")
        if not 0 < self.smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        if not self.probe_interval > 0:
            raise ValueError("probe_interval must be > 0")
        if self.probe_samples < 1:
            raise ValueError("probe_samples must be >= 1")
        if not 0 < self.backoff < 1:
            raise ValueError("backoff must be in (0, 1)")


class GradientLimit:
    """A :class:`~llm_backoff_shim.decide.limit.ConcurrencyLimit` that follows TTFB (module docstring)."""

    def __init__(self, config: GradientConfig, clock: Clock) -> None:
        self.config = config
        self._clock = clock
        self._estimate = float(config.min_limit)
        self._baseline: float | None = None
        self._probe: list[float] | None = None  # None: not probing
        self._next_probe = clock() + config.probe_interval

    @property
    def limit(self) -> int:
        if self._probe is not None:
            return self.config.min_limit
        return max(self.config.min_limit, min(self.config.max_limit, int(self._estimate)))

    @property
    def estimate(self) -> float:
        """The gradient's limit (also while a probe holds the effective limit at the minimum)."""
        return self._estimate

    @property
    def baseline(self) -> float | None:
        """The measured no-load TTFB (None before the first sample)."""
        return self._baseline

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def on_sample(self, ttfb: float, in_flight: int) -> None:
        """One TTFB measurement, taken with ``in_flight`` requests upstream (itself included)."""
        if not (ttfb > 0 and math.isfinite(ttfb)):
            return
        now = self._clock()
        if self._probe is None and now >= self._next_probe:
            self._probe = []
        if self._probe is not None:
            self._probe_sample(ttfb, in_flight, now)
            return
        self._baseline = ttfb if self._baseline is None else min(self._baseline, ttfb)
        cfg = self.config
        if in_flight < self._estimate / 2:
            return
        gradient = max(0.5, min(2.0, (1 + cfg.buffer) * self._baseline / ttfb))
        target = self._estimate * gradient + math.sqrt(self._estimate)
        estimate = self._estimate * (1 - cfg.smoothing) + target * cfg.smoothing
        self._estimate = max(float(cfg.min_limit), min(float(cfg.max_limit), estimate))

    def _probe_sample(self, ttfb: float, in_flight: int, now: float) -> None:
        assert self._probe is not None
        # Requests admitted before the probe began still run at higher concurrency.
        if in_flight > self.config.min_limit:
            return
        self._probe.append(ttfb)
        if len(self._probe) >= self.config.probe_samples:
            self._baseline = statistics.median(self._probe)
            self._probe = None
            self._next_probe = now + self.config.probe_interval

    def on_complete(self, *, service_time: float, in_flight: int, overloaded: bool) -> None:
        if overloaded:
            self._estimate = max(float(self.config.min_limit), self._estimate * self.config.backoff)
