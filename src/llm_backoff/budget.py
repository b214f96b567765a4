"""Retry budget: retries may add at most a fraction of recent first attempts.

Same model as Finagle's ``RetryBudget`` (and Envoy's / gRPC's retry throttling):
every first attempt deposits ``ratio`` of a retry into a window of the last ``ttl``
seconds, every retry withdraws one, and a constant reserve of
``min_per_second * ttl`` lets a low-traffic client retry at all. Deposits and
withdrawals both expire after ``ttl``, so the budget tracks recent traffic only.
When the balance is below one retry, :meth:`RetryBudget.try_spend` returns False
and the transport raises the failure at once: during an outage a fleet then sends
about ``1 + ratio`` times its normal load instead of ``max_attempts`` times.

Hand-written rather than taken from a library: it is ~60 lines, needs an injected
clock for deterministic tests, and no maintained Python package implements
Finagle's semantics.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

_SLICES = 10


class WindowedCounter:
    """Sum of the values added during roughly the last ``window`` seconds.

    The window is cut into ``slices`` slots (as Finagle's ``WindowedAdder``), so an
    event stops counting between ``window * (1 - 1/slices)`` and ``window`` seconds
    after it happened. Memory is constant whatever the traffic. Not locked.
    """

    __slots__ = ("_counts", "_epochs", "_slice")

    def __init__(self, window: float, slices: int = _SLICES) -> None:
        self._slice = window / slices
        self._counts = [0.0] * slices
        self._epochs = [-1] * slices

    def add(self, now: float, value: float) -> None:
        epoch = math.floor(now / self._slice)
        i = epoch % len(self._counts)
        if self._epochs[i] != epoch:
            self._epochs[i] = epoch
            self._counts[i] = 0.0
        self._counts[i] += value

    def total(self, now: float) -> float:
        oldest = math.floor(now / self._slice) - len(self._counts)
        return sum(c for c, e in zip(self._counts, self._epochs, strict=True) if e > oldest)


class RetryBudget:
    """A shareable retry budget (implements ``llm_backoff.limits.RetryBudgetLike``).

    ``ratio``: retries allowed per first attempt (0.1 = retries add at most 10 %).
    ``min_per_second``: retries always allowed per second, whatever the traffic.
    ``ttl``: seconds that a deposit or withdrawal counts for.

    Thread-safe and task-safe (the critical section is a few arithmetic operations
    under a lock, so it never blocks an event loop noticeably).
    """

    def __init__(
        self,
        ratio: float = 0.1,
        min_per_second: float = 1.0,
        ttl: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("ratio", ratio), ("min_per_second", min_per_second)):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"RetryBudget {name} must be a finite number >= 0, got {value!r}")
        if not (ttl > 0 and math.isfinite(ttl)):
            raise ValueError(f"RetryBudget ttl must be a finite number of seconds > 0, got {ttl!r}")
        self.ratio = ratio
        self.min_per_second = min_per_second
        self.ttl = ttl
        self._clock = clock
        self._reserve = min_per_second * ttl
        self._deposits = WindowedCounter(ttl)
        self._withdrawals = WindowedCounter(ttl)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RetryBudget(ratio={self.ratio}, min_per_second={self.min_per_second}, ttl={self.ttl})"

    def _balance(self, now: float) -> float:
        return self._reserve + self.ratio * self._deposits.total(now) - self._withdrawals.total(now)

    @property
    def balance(self) -> float:
        """Retries that could be spent right now (may be fractional)."""
        with self._lock:
            return self._balance(self._clock())

    def record_request(self) -> None:
        with self._lock:
            self._deposits.add(self._clock(), 1.0)

    def try_spend(self) -> bool:
        with self._lock:
            now = self._clock()
            # A small epsilon: ratio * deposits is a float sum (0.1 * 10 != 1.0).
            if self._balance(now) < 1.0 - 1e-9:
                return False
            self._withdrawals.add(now, 1.0)
            return True
