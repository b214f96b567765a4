"""Queue-time SLO: GREEN / YELLOW / RED per traffic class, and shedding by state.

Queue length is a capacity signal; queue *time* is what users feel. Each class with a
time-to-first-token budget (``--ttft-slo interactive=2,batch=60``) gets a state, judged
from the wait a request arriving now would see:

    projected = max(estimated wait of a newcomer,              # position / drain rate
                    head's queue time so far + its remaining)  # what the queue really did

- **RED** when ``projected >= budget``: new requests of the class are shed at once
  (429, ``code: slo_shed``): they would miss their budget anyway, and queueing them
  would make the requests behind them miss theirs too.
- **YELLOW** when ``projected >= yellow_fraction * budget`` (default 40 %) *and the
  wait keeps growing* (above what it was ``trend_window`` seconds ago). The first
  (highest-priority) class keeps being admitted; lower classes are shed on arrival
  and, while a higher class is YELLOW or RED, held to their minimum share of slots.
  Once YELLOW, a class stays YELLOW until its wait falls below the threshold or
  starts shrinking (hysteresis: a steady queue at 60 % of budget does not flap).
- **GREEN** otherwise: admit.

The Retry-After of an SLO shed is the time until the wait is expected back under the
line that was crossed (the queue drains one second of wait per second), never less
than the queue-based estimate; both are clamped by the estimator's range.

Pure: reads the controller's queues and estimator, time from the injected clock.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.retry_after import HintRequest, retry_after
from llm_backoff_shim.decide.tickets import Rejection
from llm_backoff_shim.decide.view import AdmissionView

Clock = Callable[[], float]


class SloState(enum.IntEnum):
    GREEN = 0
    YELLOW = 1
    RED = 2

    @property
    def header(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class SloConfig:
    budgets: Mapping[str, float]
    yellow_fraction: float = 0.4
    trend_window: float = 1.0

    def __post_init__(self) -> None:
        for cls, budget in self.budgets.items():
            if not (budget > 0 and math.isfinite(budget)):
                raise ValueError(f"ttft budget of class {cls!r} must be a positive number of seconds")
        if not 0 < self.yellow_fraction < 1:
            raise ValueError("yellow_fraction must be between 0 and 1")
        if not self.trend_window > 0:
            raise ValueError("trend_window must be > 0")


@dataclass(frozen=True)
class SloReading:
    state: SloState
    projected_wait: float
    budget: float | None


class SloTracker:
    """The SLO state of each class of one controller (module docstring)."""

    def __init__(self, config: SloConfig, controller: AdmissionController, clock: Clock) -> None:
        self.config = config
        self.controller = controller
        self._clock = clock
        self._history: dict[str, deque[tuple[float, float]]] = {c: deque() for c in controller.classes}
        self._yellow: dict[str, bool] = dict.fromkeys(controller.classes, False)

    def projected_wait(self, cls: str) -> float:
        """Seconds a request of ``cls`` arriving now is expected to wait for a slot."""
        c = self.controller
        estimator = c.estimator
        free = c.limit - c.in_flight()
        newcomer = estimator.expected_wait(c.ahead_of(cls), c.limit, free)
        if c.queued(cls) == 0:
            return newcomer
        head = c.oldest_wait(cls) + estimator.expected_wait(0, c.limit, free)
        return max(newcomer, head)

    def reading(self, cls: str) -> SloReading:
        """The current state of ``cls`` (each call is also a sample of the wait trend)."""
        budget = self.config.budgets.get(cls)
        if budget is None:
            return SloReading(SloState.GREEN, 0.0, None)
        now = self._clock()
        wait = self.projected_wait(cls)
        reference = self._sample(cls, now, wait)
        if wait >= budget:
            state = SloState.RED
        elif wait >= self.config.yellow_fraction * budget:
            growing, shrinking = wait > reference + 1e-9, wait < reference - 1e-9
            yellow = growing or (self._yellow[cls] and not shrinking)
            state = SloState.YELLOW if yellow else SloState.GREEN
        else:
            state = SloState.GREEN
        self._yellow[cls] = state is not SloState.GREEN
        return SloReading(state, wait, budget)

    def state(self, cls: str) -> SloState:
        return self.reading(cls).state

    def holds(self, cls: str | None) -> bool:
        """Hold predicate for :class:`~llm_backoff_shim.decide.classes.SharedSlots`: lower classes wait
        (beyond their minimum share) while a higher class is YELLOW or RED."""
        if cls is None:
            return False
        classes = self.controller.classes
        return any(self.state(higher) is not SloState.GREEN for higher in classes[: classes.index(cls)])

    def _sample(self, cls: str, now: float, wait: float) -> float:
        """Record ``wait``; return the wait of about ``trend_window`` seconds ago (or the oldest kept)."""
        history = self._history[cls]
        history.append((now, wait))
        # Keep one sample at or before the window's start as the reference point.
        while len(history) > 2 and history[1][0] <= now - self.config.trend_window:
            history.popleft()
        return history[0][1]


class SloGate:
    """The :class:`~llm_backoff_shim.decide.view.AdmissionGate` that sheds by SLO state."""

    def __init__(self, tracker: SloTracker) -> None:
        self.tracker = tracker

    def check(self, request: AdmissionRequest, view: AdmissionView) -> Rejection | None:
        cls = request.cls
        reading = self.tracker.reading(cls)
        if reading.budget is None or reading.state is SloState.GREEN:
            return None
        first = view.classes[0]
        if reading.state is SloState.YELLOW and cls == first:
            return None
        line = (
            reading.budget
            if reading.state is SloState.RED
            else self.tracker.config.yellow_fraction * reading.budget
        )
        return Rejection(
            code="slo_shed",
            message=(
                f"class {cls} is {reading.state.name}: estimated queue wait {reading.projected_wait:.2f} s "
                f"against a time-to-first-token budget of {reading.budget:g} s"
            ),
            retry_after=self._hint(cls, reading.projected_wait - line),
        )

    def _hint(self, cls: str, excess: float) -> float:
        c = self.tracker.controller
        queue_hint = retry_after(c.estimator, HintRequest(cls, c.ahead_of(cls), c.limit))
        cfg = c.estimator.config
        return min(cfg.retry_after_max, max(cfg.retry_after_min, queue_hint, excess))
