"""Engine-aware admission: stop sending work while the engine says it is saturated.

The pure :class:`SaturationDetector` decides from timestamped samples of the engine's own
metrics (scraped by :class:`~llm_backoff_shim.serve.policy.engine_watch.EngineWatch`):

- **saturated** when the engine reports more than ``max_waiting`` requests waiting
  (``vllm:num_requests_waiting``: it already queues work the shim sent) or KV-cache
  usage at or above ``max_kv_cache`` (``vllm:kv_cache_usage_perc``, 0..1; the older
  ``vllm:gpu_cache_usage_perc`` is read too). While saturated the shim admits
  nothing new: arrivals wait in the shim's own queues (per class, with their
  budgets) instead of in the engine's, and are admitted as soon as it recovers;
- **stale** when the last good scrape is older than ``stale_after`` seconds (the
  endpoint is down, slow or not vLLM): the detector then says nothing and the plain
  concurrency cap applies, never "unlimited" and never "nothing forever".

Between scrapes the shim keeps sending work, so a scrape alone lets the engine's queue
grow by everything admitted until the next one. The detector therefore counts the shim's
own traffic since the last scrape (``in_flight``: the shim's requests in flight now; its
change since the scrape is the admissions less the requests that left): the engine holds
about ``running + waiting + (in flight now - in flight then)`` requests, of which those
beyond its slots wait. Its slots are learned: the ``running`` of the latest scrape that
showed requests waiting (the engine was full), or more if a later scrape runs more. Until
one such scrape is seen the slots are unknown and only the scrape counts. The shim's hold
(:meth:`SaturationDetector.hold`) admits a request only if the engine's queue, with it,
stays within ``max_waiting``; another client of the same engine is seen at the next scrape.

Several engines behind one URL (or several label sets) are summed; KV usage takes
the maximum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(frozen=True)
class EngineSample:
    waiting: float
    running: float
    kv_cache: float | None


@dataclass(frozen=True)
class SaturationConfig:
    max_waiting: int = 0
    max_kv_cache: float = 0.95
    stale_after: float = 2.0

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if not 0 < self.max_kv_cache <= 1:
            raise ValueError("max_kv_cache must be in (0, 1]")
        if not self.stale_after > 0:
            raise ValueError("stale_after must be > 0")


class SaturationDetector:
    """Saturated, not saturated, or unknown (stale), from timestamped engine samples and the
    shim's own admissions since (module docstring; ``in_flight``: the shim's requests in
    flight, None to judge on the scrapes alone)."""

    def __init__(
        self, config: SaturationConfig, clock: Clock, *, in_flight: Callable[[], int] | None = None
    ) -> None:
        self.config = config
        self._clock = clock
        self._in_flight = in_flight
        self._last: EngineSample | None = None
        self._at = -math.inf
        self._in_flight_then = 0
        self._slots: float | None = None  # learned from a scrape of a full engine

    def in_flight_now(self) -> int | None:
        """The shim's requests in flight, read when a scrape is sent (:meth:`observe`'s ``then``)."""
        return None if self._in_flight is None else self._in_flight()

    def observe(self, sample: EngineSample, then: int | None = None) -> None:
        """Take a scrape; ``then``: the shim's in-flight count when it was sent. Admissions
        after that count as sent since, even those the scrape already saw (it errs towards
        holding, for one poll interval at most); one admitted before it and still on its way
        to the engine would be missed otherwise."""
        self._last = sample
        self._at = self._clock()
        if self._in_flight is not None:
            self._in_flight_then = self._in_flight() if then is None else then
        # A full engine shows its slots; the latest such scrape counts (an engine restarted
        # with fewer, or one short of KV cache, runs fewer), and more running shows more slots.
        full = sample.waiting > 0 and sample.running > 0
        if full or (self._slots is not None and sample.running > self._slots):
            self._slots = sample.running

    @property
    def engine_slots(self) -> float | None:
        """The engine's slots as learned from a scrape that showed requests waiting; None before."""
        return self._slots

    def expected_waiting(self, extra: int = 0) -> float | None:
        """Requests waiting in the engine now (with ``extra`` more sent), counting the shim's
        admissions since the last scrape once the engine's slots are known; None when stale."""
        if self.stale():
            return None
        sample = self._last
        assert sample is not None
        if self._in_flight is None or self._slots is None:
            return sample.waiting
        sent = self._in_flight() - self._in_flight_then + extra
        return max(0.0, sample.running + sample.waiting + sent - self._slots)

    @property
    def last(self) -> EngineSample | None:
        return self._last

    def stale(self) -> bool:
        return self._last is None or self._clock() - self._at > self.config.stale_after

    def saturated(self) -> bool:
        """True only on fresh evidence of saturation; stale or missing metrics are never saturation."""
        waiting = self.expected_waiting()
        if waiting is None:
            return False
        if waiting > self.config.max_waiting:
            return True
        return self._kv_full()

    def hold(self, cls: str | None) -> bool:
        """Hold predicate for :class:`~llm_backoff_shim.decide.classes.SharedSlots`: everything waits
        while one more request would leave more than ``max_waiting`` waiting in the engine,
        or its KV cache is full."""
        if cls is not None:
            return False
        waiting = self.expected_waiting(1)
        if waiting is None:
            return False
        return waiting > self.config.max_waiting or self._kv_full()

    def _kv_full(self) -> bool:
        sample = self._last
        kv = None if sample is None else sample.kv_cache
        return kv is not None and kv >= self.config.max_kv_cache
