"""What a run of :class:`~llm_backoff_shim.lab.overload_model.OverloadModel` returns: each
caller's call on the virtual clock, the engine's idle time, and the figures read off them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from llm_backoff.attempts import RetryState
from llm_backoff_shim.decide.tickets import Ticket
from llm_backoff_shim.lab.scenario import Arrival


@dataclass
class ModelCall:
    """One caller's call: what it sent and what it got, on the virtual clock."""

    arrival: Arrival
    start: float
    state: RetryState
    #: Output tokens it asks for and gets, and the seconds that holds a slot (before jitter).
    tokens: int = 0
    service: float = 0.0
    attempts: list[str] = field(default_factory=list)  # "refused" | "queued" | "admitted"
    #: Seconds from each refused attempt to its refusal: 0 when refused at once, else the time
    #: it waited in the queue before being turned away (queue_timeout).
    refusal_times: list[float] = field(default_factory=list)
    attempt_at: float = 0.0
    ticket: Ticket | None = None
    first_token: float | None = None
    end: float | None = None
    outcome: str = "pending"  # "ok" | "gave up" | "deadline"

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


@dataclass(frozen=True)
class ModelResult:
    """One run's calls and what the engine did.

    ``idle_while_servable``: slot-seconds a slot stood free while a caller that could still
    have been served (admitted then, it would have ended within its deadline and, for an
    interactive caller that states a TTFT budget, begun within it) was waiting, queued or
    between attempts; at any instant the smaller of the free slots and such callers counts.
    ``useful_tokens``: tokens of the calls served usefully (:meth:`useful`);
    ``capacity_tokens``: the most any scheduler could deliver, the engine's tokens per second
    with every slot busy times the arrival window plus the deadline; ``offered_tokens``:
    what the callers asked for.
    """

    calls: tuple[ModelCall, ...]
    retry_times: tuple[float, ...]
    idle_slot_seconds: float
    last_completion: float
    slots: int = 1
    idle_while_servable: float = 0.0
    useful_tokens: int = 0
    capacity_tokens: float = 0.0
    offered_tokens: int = 0

    @property
    def idle_while_servable_share(self) -> float:
        """:attr:`idle_while_servable` over the engine's slot-time up to its last completion."""
        span = self.slots * self.last_completion
        return self.idle_while_servable / span if span > 0 else 0.0

    @property
    def useful_share(self) -> float:
        """Useful tokens over the capacity bound ("of what the engine could have")."""
        return self.useful_tokens / self.capacity_tokens if self.capacity_tokens > 0 else 0.0

    @property
    def successes(self) -> int:
        return sum(c.ok for c in self.calls)

    @property
    def attempts(self) -> int:
        return sum(len(c.attempts) for c in self.calls)

    @property
    def refused_after_a_wait(self) -> list[float]:
        """How long each attempt turned away after queueing had waited (seconds)."""
        return [t for c in self.calls for t in c.refusal_times if t > 0]

    @property
    def largest_retry_wave(self) -> int:
        """The most retries sent within any 100 ms window."""
        times = sorted(self.retry_times)
        most, lo = 0, 0
        for hi, t in enumerate(times):
            while t - times[lo] >= 0.1:
                lo += 1
            most = max(most, hi - lo + 1)
        return most

    @property
    def first_retry_admitted(self) -> tuple[int, int]:
        """(admitted, retried): of calls refused first that retried, how many were not refused again."""
        retried = [c for c in self.calls if len(c.attempts) >= 2 and c.attempts[0] == "refused"]
        return sum(c.attempts[1] in ("queued", "admitted") for c in retried), len(retried)

    def ttft_p99(self, cls: str = "interactive") -> float | None:
        """p99 time to first token of the served calls of ``cls`` (nearest rank)."""
        ttfts = sorted(
            c.first_token - c.start
            for c in self.calls
            if c.ok and c.first_token is not None and c.arrival.cls == cls
        )
        return ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)] if ttfts else None

    def summary(self) -> str:
        admitted, retried = self.first_retry_admitted
        share = f"{admitted / retried:.0%}" if retried else "-"
        ttft = self.ttft_p99()
        p99 = "-" if ttft is None else f"{ttft:.2f}"
        served = sum(c.ok for c in self.calls if c.arrival.cls == "interactive")
        return (
            f"{self.successes}/{len(self.calls)} ok ({served} interactive, TTFT p99 {p99} s), "
            f"{self.attempts / len(self.calls):.2f} attempts/call, "
            f"first retry admitted {share} of {retried}, wave {self.largest_retry_wave}, "
            f"idle {self.idle_slot_seconds:.1f} slot-s to {self.last_completion:.1f} s"
        )


def burst_report(results: Sequence[ModelResult]) -> str:
    """Successes over seeds: the spread a policy change must be judged against."""
    counts = Counter(r.successes for r in results)
    spread = ", ".join(f"{n}: {counts[n]}" for n in sorted(counts))
    return f"successes over {len(results)} seeds -> {spread}"
