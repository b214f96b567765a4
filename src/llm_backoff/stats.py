"""Per-client counters: what a wrapped client has been doing, in numbers.

Every client made by `llm_backoff.wrap` carries a `ClientStats` (``llm_backoff.client_stats(client)``),
fed by its transport as a `CallObserver`; clients derived with ``copy()`` /
``with_options()`` share their parent's, since they share its transport. Counting
starts at ``wrap()``: nothing has to be switched on, so the numbers cover the
client's whole life.

Thread- and task-safe: each update takes one short lock (reading an ``int``
attribute needs none; `snapshot` gives a consistent set). A call costs one update
when nothing goes wrong (``call_ended``); retries, limiter waits and budget refusals
add one each.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from .events import CallObserver, RetryEvent

#: A limiter answer slower than this counts as a wait; faster ones are the cost of asking.
WAIT_THRESHOLD = 0.001


@dataclass(frozen=True)
class StatsSnapshot:
    """The counters of one client at one moment. ``later - earlier`` gives the activity between."""

    calls: int = 0
    """Logical calls finished (each may have made several attempts)."""
    failed_calls: int = 0
    """Calls that ended in an error response (>= 400) or an exception, after any retries."""
    cancelled_calls: int = 0
    """Calls whose task was cancelled (or interrupted) mid-call."""
    attempts: int = 0
    """HTTP attempts that got a response or an error."""
    retries: int = 0
    retries_by_reason: Mapping[str, int] = field(default_factory=dict)
    """``{"status 429": 3, "timeout (ReadTimeout)": 1}``: one key per kind of failure (a bounded set)."""
    retry_wait_seconds: float = 0.0
    """Backoff waits chosen between attempts (skipped, but still counted, under ``instant_retries``)."""
    budget_refusals: int = 0
    """Retries the retry budget refused (the call gave up instead)."""
    limiter_acquisitions: int = 0
    """Permits the client-side limiter granted (one per attempt when a limiter is set)."""
    limiter_waits: int = 0
    """Acquisitions that had to wait (at least `WAIT_THRESHOLD`)."""
    limiter_wait_seconds: float = 0.0
    """Time spent in those waits."""
    limiter_timeouts: int = 0
    """Calls the limiter refused with `RateLimitTimeout` (the wait would pass the deadline)."""

    def __sub__(self, other: StatsSnapshot) -> StatsSnapshot:
        if not isinstance(other, StatsSnapshot):
            return NotImplemented
        numbers: dict[str, Any] = {
            f.name: getattr(self, f.name) - getattr(other, f.name)
            for f in fields(self)
            if f.name != "retries_by_reason"
        }
        reasons = {
            reason: count - other.retries_by_reason.get(reason, 0)
            for reason, count in self.retries_by_reason.items()
        }
        return StatsSnapshot(**numbers, retries_by_reason={r: n for r, n in reasons.items() if n})

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for logs, JSON)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["retries_by_reason"] = dict(self.retries_by_reason)
        return data


class ClientStats(CallObserver):
    """Live counters of one wrapped client; see `StatsSnapshot` for what each one means."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.failed_calls = 0
        self.cancelled_calls = 0
        self.attempts = 0
        self.retries = 0
        self._by_reason: dict[str, int] = {}
        self.retry_wait_seconds = 0.0
        self.budget_refusals = 0
        self.limiter_acquisitions = 0
        self.limiter_waits = 0
        self.limiter_wait_seconds = 0.0
        self.limiter_timeouts = 0

    def __repr__(self) -> str:
        s = self.snapshot()
        return (
            f"ClientStats(calls={s.calls}, failed_calls={s.failed_calls}, attempts={s.attempts}, "
            f"retries={s.retries}, retry_wait_seconds={s.retry_wait_seconds:.3f}, "
            f"budget_refusals={s.budget_refusals}, limiter_waits={s.limiter_waits})"
        )

    @property
    def retries_by_reason(self) -> Mapping[str, int]:
        """A read-only copy (the live dict may change while you iterate)."""
        with self._lock:
            return MappingProxyType(dict(self._by_reason))

    def snapshot(self) -> StatsSnapshot:
        """All counters, read together."""
        with self._lock:
            return StatsSnapshot(
                calls=self.calls,
                failed_calls=self.failed_calls,
                cancelled_calls=self.cancelled_calls,
                attempts=self.attempts,
                retries=self.retries,
                retries_by_reason=MappingProxyType(dict(self._by_reason)),
                retry_wait_seconds=self.retry_wait_seconds,
                budget_refusals=self.budget_refusals,
                limiter_acquisitions=self.limiter_acquisitions,
                limiter_waits=self.limiter_waits,
                limiter_wait_seconds=self.limiter_wait_seconds,
                limiter_timeouts=self.limiter_timeouts,
            )

    # -- CallObserver ----------------------------------------------------------------

    def call_ended(self, outcome: str, attempts: int) -> None:
        with self._lock:
            self.calls += 1
            self.attempts += attempts
            if outcome == "failed":
                self.failed_calls += 1
            elif outcome == "cancelled":
                self.cancelled_calls += 1

    def retrying(self, event: RetryEvent) -> None:
        with self._lock:
            self.retries += 1
            self._by_reason[event.reason] = self._by_reason.get(event.reason, 0) + 1
            self.retry_wait_seconds += event.wait

    def budget_refused(self) -> None:
        with self._lock:
            self.budget_refusals += 1

    def limiter_waited(self, seconds: float, *, granted: bool) -> None:
        with self._lock:
            if granted:
                self.limiter_acquisitions += 1
            else:
                self.limiter_timeouts += 1
            if seconds >= WAIT_THRESHOLD:
                self.limiter_waits += 1
                self.limiter_wait_seconds += seconds
