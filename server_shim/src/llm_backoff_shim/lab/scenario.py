"""What the demo and the overload benchmark drive: the engine's shape, the load, the set-ups.

Pure definitions, no I/O. :func:`arrivals` turns a :class:`Scenario` into a seeded,
reproducible list of calls, so every configuration of one run faces exactly the
same load (same instants, same classes).

Choices made here, and why:

- The simulated engine runs with ``itl_batch_factor = 0`` so that its capacity is
  exactly ``slots / (ttft + (output_tokens - 1) * itl)`` requests/s; the figure printed is
  then the true ceiling and goodput can be read against it without a model of batching.
- The burst arrives at t = 0 and the Poisson arrivals start right after it, so the
  engine never gets the time to drain the burst before the sustained overload.
- Classes are drawn per call (``interactive_share`` interactive, the rest batch).
  Each class has its own deadline (``deadline`` for interactive, ``batch_deadline`` for
  batch, the same when that is unset) and its own TTFT budget (``ttft_budget`` for
  interactive; a batch caller's is its deadline): a call is *served within budget*
  when it completes before its deadline and its first token came within its budget.
- With a :class:`~llm_backoff_shim.lab.workload.Workload`, every call has its own prompt
  and ``max_tokens`` drawn from it, from a second RNG seeded off the first once the
  instants and classes are drawn: the same seed gives the same instants and classes
  with or without lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from llm_backoff_shim.lab.workload import Workload
from llm_backoff_shim.sim.profiles import PROFILES

RequestClass = Literal["interactive", "batch"]
#: ``llm_backoff_presets``: ``wrap(client, request_class=cls)`` with no policy, so each class
#: gets the SDK's preset (`RetryPolicy.interactive` / `RetryPolicy.batch`).
ClientKind = Literal["plain", "llm_backoff", "llm_backoff_presets"]
Route = Literal["engine", "shim", "peer"]


@dataclass(frozen=True)
class EngineShape:
    """The simulator's settings (8 slots, 1.2 s per request of 20 tokens by default).

    ``output_tokens`` is the length of an answer when the request sets no ``max_tokens``
    (fixed: the simulator runs with ``--output-tokens-sigma 0``); ``prefill_time_per_token``
    the simulator's prefill cost (``--prefill-time-per-token``). ``itl_batch_factor``: the
    batch slows tokens down (``--itl-batch-factor``), and the service times below are those
    with every slot busy. ``profile``: the simulator runs ``--profile NAME`` (its KV cache
    and step size), the fields above given explicitly (:meth:`from_profile` reads them).
    """

    slots: int = 8
    ttft: float = 0.25
    itl: float = 0.05
    output_tokens: int = 20
    prefill_time_per_token: float = 0.0002
    itl_batch_factor: float = 0.0
    profile: str | None = None

    @classmethod
    def from_profile(cls, name: str, *, output_tokens: int = 64) -> EngineShape:
        """The engine of ``llm-backoff-shim sim --profile NAME`` (``sim.profiles``)."""
        d = PROFILES[name].defaults
        return cls(
            slots=int(d["max_num_seqs"]),  # type: ignore[call-overload]
            ttft=float(d["ttft"]),  # type: ignore[arg-type]
            itl=float(d["itl"]),  # type: ignore[arg-type]
            output_tokens=output_tokens,
            prefill_time_per_token=float(d["prefill_time_per_token"]),  # type: ignore[arg-type]
            itl_batch_factor=float(d["itl_batch_factor"]),  # type: ignore[arg-type]
            profile=name,
        )

    @property
    def full_itl(self) -> float:
        """Seconds between two tokens of a sequence with every slot busy."""
        return self.itl * (1.0 + self.itl_batch_factor * (self.slots - 1))

    def __post_init__(self) -> None:
        if self.slots < 1 or self.output_tokens < 1:
            raise ValueError("slots and output_tokens must be >= 1")
        if not (self.ttft >= 0 and self.itl >= 0 and self.service_time > 0):
            raise ValueError("ttft and itl must be >= 0 and give a positive service time")

    @property
    def service_time(self) -> float:
        """Seconds one request holds a slot: first token at ``ttft``, then one per ``itl``.

        With ``itl_batch_factor`` 0 (the default) the batch does not slow tokens down and this
        holds at any load; otherwise it is the time with every slot busy (:attr:`full_itl`).
        """
        return self.ttft + (self.output_tokens - 1) * self.full_itl

    @property
    def capacity(self) -> float:
        """Completions per second the engine sustains with every slot busy."""
        return self.slots / self.service_time

    def service_time_for(self, workload: Workload | None) -> float:
        """Mean seconds a request of ``workload`` holds a slot: its mean answer length, and its
        mean prompt's prefill (1.3 tokens per word plus the chat template's 4, as the
        simulator counts)."""
        if workload is None:
            return self.service_time
        prompt_tokens = 1.3 * workload.prompt_words.mean() + 4
        return (
            self.ttft
            + prompt_tokens * self.prefill_time_per_token
            + (workload.output_tokens.mean() - 1) * self.full_itl
        )

    def longest_service_for(self, workload: Workload | None) -> float:
        """Seconds the longest request ``workload`` can draw holds a slot: its longest prompt's
        prefill and its largest ``max_tokens`` at full batch. A deadline shorter than this (plus
        the time a caller may wait before its answer starts) cuts that answer whatever the
        scheduler does, and the engine's tokens for it are wasted."""
        if workload is None:
            return self.service_time
        prompt_tokens = 1.3 * workload.prompt_words.high + 4
        return (
            self.ttft
            + prompt_tokens * self.prefill_time_per_token
            + (workload.output_tokens.high - 1) * self.full_itl
        )

    def capacity_for(self, workload: Workload | None) -> float:
        """Completions per second for ``workload``'s lengths with every slot busy."""
        return self.slots / self.service_time_for(workload)

    def token_capacity_for(self, workload: Workload | None) -> float:
        """Answer tokens per second for ``workload`` with every slot busy."""
        mean = self.output_tokens if workload is None else workload.output_tokens.mean()
        return self.capacity_for(workload) * mean

    def sim_flags(self) -> list[str]:
        profile = [] if self.profile is None else ["--profile", self.profile]
        return [
            *profile,
            "--max-num-seqs",
            str(self.slots),
            "--ttft",
            repr(self.ttft),
            "--itl",
            repr(self.itl),
            "--itl-batch-factor",
            f"{self.itl_batch_factor:g}",
            "--output-tokens",
            str(self.output_tokens),
            "--output-tokens-sigma",
            "0",
            "--prefill-time-per-token",
            repr(self.prefill_time_per_token),
        ]


@dataclass(frozen=True)
class Scenario:
    """A burst at t = 0, then Poisson arrivals at ``rate_factor`` x capacity for ``duration`` s.

    ``start_deadline``: interactive ``llm_backoff`` callers state ``ttft_budget`` as their
    ``RetryPolicy(start_deadline=...)`` (callers.retry_policy); off, their only budget is
    ``deadline``, the call's.

    ``deadline`` is the interactive callers' deadline, and the batch callers' too unless
    ``batch_deadline`` is set. ``workload``: per-call prompt and answer lengths; None sends
    a short fixed prompt and no ``max_tokens`` (the engine's own answer length).
    """

    name: str
    burst: int
    rate_factor: float
    duration: float
    deadline: float
    ttft_budget: float
    interactive_share: float = 0.7
    start_deadline: bool = True
    batch_deadline: float | None = None
    workload: Workload | None = None

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
        if self.batch_deadline is not None and not (
            self.batch_deadline > 0 and math.isfinite(self.batch_deadline)
        ):
            raise ValueError("batch_deadline must be a positive finite number of seconds")

    def deadline_of(self, cls: RequestClass) -> float:
        """The deadline of a call of ``cls``, seconds from its start."""
        if cls == "batch" and self.batch_deadline is not None:
            return self.batch_deadline
        return self.deadline

    def ttft_budget_of(self, cls: RequestClass) -> float:
        """The time to first token a caller of ``cls`` accepts: interactive ``ttft_budget``,
        batch its deadline."""
        return self.ttft_budget if cls == "interactive" else self.deadline_of(cls)

    @property
    def longest_deadline(self) -> float:
        return max(self.deadline_of("interactive"), self.deadline_of("batch"))

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
        if self.batch_deadline is not None and self.batch_deadline != self.deadline:
            budget = f"deadline {self.deadline:g} s (interactive) / {self.batch_deadline:g} s (batch)"
        if self.start_deadline:
            budget += f" (llm_backoff's interactive callers: to begin within {self.ttft_budget:g} s)"
        lengths = "" if self.workload is None else f"; {self.workload.describe()}"
        return f"{', then '.join(parts)}; {mix}; {budget}{lengths}"


@dataclass(frozen=True)
class Arrival:
    """One call: when it starts, its class and, with a workload, its prompt and ``max_tokens``.

    ``prompt`` None: the load generator sends a short fixed prompt naming the call.
    ``max_tokens`` None: no limit is sent. ``ignore_eos``: send vLLM's ``ignore_eos``.
    ``answer_tokens``: the caller closes its stream once this many content chunks came (an
    answer of that length, whatever ``max_tokens`` says: how a client that sends a high
    ``max_tokens``, or none, is played with answers of a chosen length); None: read to the end.
    ``api_key``: the key the call is sent with (its tenant, to the shim); None: the client's.
    """

    index: int
    at: float
    cls: RequestClass
    prompt: str | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False
    answer_tokens: int | None = None
    api_key: str | None = None


def arrivals(scenario: Scenario, capacity: float, rng: random.Random) -> list[Arrival]:
    """The calls of one run, in time order; the same ``rng`` state gives the same list."""
    times = [0.0] * scenario.burst
    rate = scenario.rate_factor * capacity
    if rate > 0 and scenario.duration > 0:
        t = rng.expovariate(rate)
        while t < scenario.duration:
            times.append(t)
            t += rng.expovariate(rate)
    classes: list[RequestClass] = [
        "interactive" if rng.random() < scenario.interactive_share else "batch" for _ in times
    ]
    workload = scenario.workload
    if workload is None:
        return [Arrival(i, at, cls) for i, (at, cls) in enumerate(zip(times, classes, strict=True))]
    lengths = random.Random(rng.getrandbits(64))
    calls = []
    for i, (at, cls) in enumerate(zip(times, classes, strict=True)):
        prompt, max_tokens = workload.draw(lengths)
        calls.append(Arrival(i, at, cls, prompt, max_tokens, workload.ignore_eos))
    return calls


@dataclass(frozen=True)
class Setup:
    """One configuration: which client, pointed at which server. ``interactive_fields``: with
    ``llm_backoff_presets``, fields given to the interactive preset (``RetryPolicy.interactive``,
    e.g. ``(("max_retry_after", 1.0),)``), to measure what one of its choices costs or buys."""

    label: str
    route: Route
    client: ClientKind
    interactive_fields: tuple[tuple[str, float | None], ...] = ()


DIRECT_PLAIN = Setup("direct + plain openai", "engine", "plain")
SHIM_PLAIN = Setup("shim + plain openai", "shim", "plain")
SHIM_BACKOFF = Setup("shim + llm_backoff", "shim", "llm_backoff")
SHIM_PRESETS = Setup("shim + llm_backoff presets", "shim", "llm_backoff_presets")
DEMO_SETUPS: tuple[Setup, ...] = (DIRECT_PLAIN, SHIM_PLAIN, SHIM_BACKOFF)


def demo_scenario(*, quick: bool, duration: float | None = None) -> Scenario:
    """The demo's load with fixed lengths (``llm-backoff-shim demo --fixed-lengths``, on
    :class:`EngineShape`'s defaults; what the virtual-time overload model replays): a burst,
    then 2x capacity; ~16 s per run (~5 s with ``quick``).

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


#: The demo's engine: 8 slots, 100 tokens/s per sequence (a fast GPU's pace, so a run of
#: varied answers fits in seconds), 0.1 s to a first token.
DEMO_SHAPE = EngineShape(slots=8, ttft=0.1, itl=0.01, output_tokens=64)


def varied_demo_scenario(*, quick: bool, duration: float | None = None) -> Scenario:
    """The demo's default load: a burst, then 2x capacity, with varied lengths (the default
    :class:`~llm_backoff_shim.lab.workload.Workload`); ~20 s per run (~11 s with ``quick``).

    The burst is larger than the shim's slots plus queue (8 + 16), so every shim run turns
    callers away from the first second on. Interactive callers want a first token within
    2 s and the whole answer within 8 s; batch callers have 12 s, half of it held in the shim.
    ``quick`` keeps the burst and shortens the arrivals (3 s), not the budgets: every answer the
    workload can draw (512 tokens, 5.3 s on :data:`DEMO_SHAPE`) still fits after the longest
    wait a caller accepts (the TTFT budget, or batch's hold), so no answer is cut by a
    deadline no scheduler could meet: shorter budgets (4 s, 1.5 s, batch 6 s) cut every answer
    past ~250 tokens that began at the budget, and llm_backoff's run of seed 1 wasted 28 % of
    the engine's tokens on 6 such streams.
    """
    return Scenario(
        "demo-quick" if quick else "demo",
        burst=40,
        rate_factor=2.0,
        duration=duration or (3.0 if quick else 8.0),
        deadline=8.0,
        ttft_budget=2.0,
        batch_deadline=12.0,
        workload=Workload(),
    )


def profile_demo_scenario(shape: EngineShape, *, quick: bool, duration: float | None = None) -> Scenario:
    """The demo's load on a GPU-like engine (``demo --profile``): the default one's shape, sized
    to ``shape``'s slots and pace.

    The burst is again larger than the shim's slots plus queue (3 x slots + 16); interactive
    callers want a first token within 2 s and the answer within 3 times the mean request's
    time at full batch (at least 8 s); batch callers have 1.5 times that. Arrivals at 2x
    capacity for 8 s (3 s quick).
    """
    workload = Workload()
    deadline = max(8.0, math.ceil(3 * shape.service_time_for(workload)))
    return Scenario(
        f"demo-{shape.profile or 'engine'}" + ("-quick" if quick else ""),
        burst=3 * shape.slots + 16,
        rate_factor=2.0,
        duration=duration or (3.0 if quick else 8.0),
        deadline=deadline,
        ttft_budget=2.0,
        batch_deadline=1.5 * deadline,
        workload=workload,
    )
