"""What the demo and the overload benchmark drive: the engine's shape, the load, the set-ups.

Pure definitions, no I/O. :func:`arrivals` turns a :class:`Scenario` into a seeded,
reproducible list of calls, so every configuration of one run faces exactly the
same load (same instants, same classes).

Choices made here (written down because the issue does not fix them):

- The simulated engine runs with ``itl_batch_factor = 0`` so that its capacity is
  exactly ``slots / (ttft + (output_tokens - 1) * itl)`` requests/s; the figure printed is
  then the true ceiling and goodput can be read against it without a model of batching.
- The burst arrives at t = 0 and the Poisson arrivals start right after it, so the
  engine never gets the time to drain the burst before the sustained overload.
- Classes are drawn per call (``interactive_share`` interactive, the rest batch);
  both classes have the same deadline, interactive calls also have a TTFT budget
  that the report compares p99 TTFT against.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

RequestClass = Literal["interactive", "batch"]
ClientKind = Literal["plain", "llm_backoff"]
Route = Literal["engine", "shim", "peer"]


@dataclass(frozen=True)
class EngineShape:
    """The simulator's settings (8 slots, 1.2 s per request by default)."""

    slots: int = 8
    ttft: float = 0.25
    itl: float = 0.05
    output_tokens: int = 20

    def __post_init__(self) -> None:
        if self.slots < 1 or self.output_tokens < 1:
            raise ValueError("slots and output_tokens must be >= 1")
        if not (self.ttft >= 0 and self.itl >= 0 and self.service_time > 0):
            raise ValueError("ttft and itl must be >= 0 and give a positive service time")

    @property
    def service_time(self) -> float:
        """Seconds one request holds a slot: first token at ``ttft``, then one per ``itl``.

        The batch does not slow tokens down (``itl_batch_factor`` 0), so this holds at any load.
        """
        return self.ttft + (self.output_tokens - 1) * self.itl

    @property
    def capacity(self) -> float:
        """Completions per second the engine sustains with every slot busy."""
        return self.slots / self.service_time

    def sim_flags(self) -> list[str]:
        return [
            "--max-num-seqs",
            str(self.slots),
            "--ttft",
            repr(self.ttft),
            "--itl",
            repr(self.itl),
            "--itl-batch-factor",
            "0",
            "--output-tokens",
            str(self.output_tokens),
        ]


@dataclass(frozen=True)
class Scenario:
    """A burst at t = 0, then Poisson arrivals at ``rate_factor`` x capacity for ``duration`` s.

    ``start_deadline``: interactive ``llm_backoff`` callers state ``ttft_budget`` as their
    ``RetryPolicy(start_deadline=...)`` (loadgen.retry_policy); off, their only budget is
    ``deadline``, the call's.
    """

    name: str
    burst: int
    rate_factor: float
    duration: float
    deadline: float
    ttft_budget: float
    interactive_share: float = 0.7
    start_deadline: bool = True

    def __post_init__(self) -> None:
        if self.burst < 0:
            raise ValueError("burst must be >= 0")
        if not (math.isfinite(self.rate_factor) and self.rate_factor >= 0):
            raise ValueError("rate_factor must be a finite number >= 0")
        if not (math.isfinite(self.duration) and self.duration >= 0):
            raise ValueError("duration must be a finite number >= 0")
        if self.burst == 0 and (self.rate_factor == 0 or self.duration == 0):
            raise ValueError(f"scenario {self.name!r} has no load: give a burst or a rate and duration")
        if not (self.deadline > 0 and math.isfinite(self.deadline)):
            raise ValueError("deadline must be a positive finite number of seconds")
        if not 0 < self.ttft_budget <= self.deadline:
            raise ValueError("ttft_budget must be in (0, deadline]")
        if not 0 <= self.interactive_share <= 1:
            raise ValueError("interactive_share must be in [0, 1]")

    def describe(self, capacity: float) -> str:
        parts = []
        if self.burst:
            parts.append(f"burst of {self.burst} at t=0")
        if self.rate_factor and self.duration:
            parts.append(
                f"Poisson {self.rate_factor:g}x capacity ({self.rate_factor * capacity:.1f}/s) "
                f"for {self.duration:g} s"
            )
        mix = f"{self.interactive_share:.0%} interactive"
        budget = f"deadline {self.deadline:g} s per call"
        if self.start_deadline:
            budget += f" (llm_backoff's interactive callers: to begin within {self.ttft_budget:g} s)"
        return f"{', then '.join(parts)}; {mix}; {budget}"


@dataclass(frozen=True)
class Arrival:
    index: int
    at: float
    cls: RequestClass


def arrivals(scenario: Scenario, capacity: float, rng: random.Random) -> list[Arrival]:
    """The calls of one run, in time order; the same ``rng`` state gives the same list."""
    times = [0.0] * scenario.burst
    rate = scenario.rate_factor * capacity
    if rate > 0 and scenario.duration > 0:
        t = rng.expovariate(rate)
        while t < scenario.duration:
            times.append(t)
            t += rng.expovariate(rate)
    return [
        Arrival(i, at, "interactive" if rng.random() < scenario.interactive_share else "batch")
        for i, at in enumerate(times)
    ]


@dataclass(frozen=True)
class Setup:
    """One configuration: which client, pointed at which server."""

    label: str
    route: Route
    client: ClientKind


DIRECT_PLAIN = Setup("direct + plain openai", "engine", "plain")
SHIM_PLAIN = Setup("shim + plain openai", "shim", "plain")
SHIM_BACKOFF = Setup("shim + llm_backoff", "shim", "llm_backoff")
DEMO_SETUPS: tuple[Setup, ...] = (DIRECT_PLAIN, SHIM_PLAIN, SHIM_BACKOFF)


def demo_scenario(*, quick: bool, duration: float | None = None) -> Scenario:
    """The demo's load: a burst, then 2x capacity; ~16 s per run (~5 s with ``quick``).

    The burst is larger than the shim's slots plus queue (8 + 16), so every shim run
    turns callers away from the first second on.
    """
    if quick:
        return Scenario(
            "demo-quick", burst=30, rate_factor=2.0, duration=duration or 2.0, deadline=3.0, ttft_budget=1.5
        )
    return Scenario(
        "demo", burst=40, rate_factor=2.0, duration=duration or 8.0, deadline=8.0, ttft_budget=4.0
    )
