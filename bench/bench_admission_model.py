"""The admission model in virtual time: the shim's real admission decisions, no sockets, no sleeping.

    .venv/bin/python bench/bench_admission_model.py                               # 30 seeds
    .venv/bin/python bench/bench_admission_model.py --seeds 20 --lengths 20,0.8,160
    .venv/bin/python bench/bench_admission_model.py --lengths 20,0.8,160 --shim-flags "--max-queue 16"

The overload scenarios (a burst of 200, 2x and 1.2x the engine for 30 s, the demo's load; with
``--lengths``, the varied-2x pair), ~0.1 s a run, so a change to admission shows over 20-100
seeds in seconds (docs/benchmarks.md). Before/after: rerun with the other tree first on ``PYTHONPATH``.

**The model** (:class:`OverloadModel`): the shim's ``AdmissionController`` built from its flags
(``build_controller``) and the SDK's ``RetryState`` on a ``ManualClock`` moved event to event;
the shim's asyncio edge (``serve.request_path.waiting``) replayed step for step. Left out: the
network, the processes' delays, and the engine's variation unless asked (``service_jitter``;
:class:`OutputLengths` per-call lengths asked as ``max_tokens`` with ``ignore_eos``).

**The oracle** (:func:`schedule`, also used by the scoreboard's fleet scenario,
``fleet_scenario.py``): an upper bound on useful tokens from greedy EDF on each request's latest
useful start over ``slots`` slots, knowing every service time (greedy EDF is not optimal under
overload, but never idles a slot while a servable request waits nor serves one uselessly).
Pure: no clock, no I/O.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import heapq
import itertools
import math
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from llm_backoff import RetryBudget
from llm_backoff.attempts import GiveUp, RetryState
from llm_backoff.classify import Verdict
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Dispatch, Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.lab.callers import retry_policy
from llm_backoff_shim.lab.demo import shim_flags
from llm_backoff_shim.lab.figures import max_in_window, percentile
from llm_backoff_shim.lab.scenario import Arrival, EngineShape, Scenario, arrivals, demo_scenario
from llm_backoff_shim.serve.app import build_controller
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.testing import ManualClock

# -- the model ----------------------------------------------------------------------------------

_REFUSED = Verdict(True, "429")


@dataclass(frozen=True)
class OutputLengths:
    """Output tokens per call: a lognormal with this ``median`` and ``sigma``, rounded, in 1..``cap``;
    asked as ``max_tokens`` with ``ignore_eos``, so the call holds its slot ``ttft + (tokens - 1) * itl``."""

    median: float
    sigma: float
    cap: int

    def __post_init__(self) -> None:
        if not (self.median >= 1 and math.isfinite(self.median)):
            raise ValueError("median must be a finite number >= 1")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError("sigma must be a finite number >= 0")
        if self.cap < 1:
            raise ValueError("cap must be >= 1")

    def draw(self, rng: random.Random) -> int:
        return max(1, min(self.cap, round(rng.lognormvariate(math.log(self.median), self.sigma))))

    def mean(self) -> float:
        """The expected draw, the cap included (midpoint rule over 4,000 quantiles)."""
        normal, n = NormalDist(math.log(self.median), self.sigma or 1e-12), 4000
        draws = (round(math.exp(normal.inv_cdf((i + 0.5) / n))) for i in range(n))
        return sum(max(1, min(self.cap, d)) for d in draws) / n


def service_of(shape: EngineShape, tokens: int) -> float:
    """Seconds a call generating ``tokens`` holds its slot: first token at ``ttft``, then one per ``itl``."""
    return shape.ttft + (tokens - 1) * shape.itl


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
    #: Seconds from each refused attempt to its refusal: 0 when at once, else its wait in the queue.
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
    """One run's calls and what the engine did. ``idle_while_servable``: slot-seconds free while a
    caller that could still have been served usefully waited (queued or between attempts), the
    smaller of the two counts at each instant; ``useful_tokens``: of the calls served usefully
    (:meth:`OverloadModel.useful`); ``capacity_tokens``: the engine's full-load tokens/s times the
    arrival window plus the deadline; ``offered_tokens``: what the callers asked for."""

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
        return max_in_window(self.retry_times, 0.1)

    @property
    def first_retry_admitted(self) -> tuple[int, int]:
        """(admitted, retried): of calls refused first that retried, how many were not refused again."""
        retried = [c for c in self.calls if len(c.attempts) >= 2 and c.attempts[0] == "refused"]
        return sum(c.attempts[1] in ("queued", "admitted") for c in retried), len(retried)

    def ttft_p99(self, cls: str = "interactive") -> float | None:
        """p99 time to first token of the served calls of ``cls`` (nearest rank)."""
        served = [c for c in self.calls if c.ok and c.arrival.cls == cls]
        return percentile([c.first_token - c.start for c in served if c.first_token is not None], 99)

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


class OverloadModel:
    """One scenario, one seed: :meth:`run` plays it to the end."""

    def __init__(
        self,
        scenario: Scenario,
        shape: EngineShape,
        shim_flags: Sequence[str],
        *,
        seed: int = 1,
        service_jitter: float = 0.0,
        lengths: OutputLengths | None = None,
        start_deadline: bool | None = None,
    ) -> None:
        self.scenario, self.shape = scenario, shape
        self.clock = ManualClock(0.0)
        settings = load_settings(["--upstream", "http://127.0.0.1:9", *shim_flags])
        self.controller = build_controller(settings, self.clock)
        # Whether interactive callers state their TTFT budget: the scenario's choice by default.
        self.start_deadline = scenario.start_deadline if start_deadline is None else start_deadline
        # Each call's output length: fixed (the shape's), or drawn (its own Random, so that the
        # arrivals of a seed are those of the fixed runs at the same rate factor).
        self.lengths = lengths
        mean_tokens = shape.output_tokens if lengths is None else lengths.mean()
        mean_service = service_of(shape, 1) + (mean_tokens - 1) * shape.itl
        #: Completions per second and tokens per second with every slot busy.
        self.capacity = shape.slots / mean_service
        self.token_rate = self.capacity * mean_tokens
        self._lengths_rng = random.Random(seed + 3)
        # The load generator's arrivals for this seed (the loopback load seeds its Random alike).
        self.arrivals = arrivals(scenario, self.capacity, random.Random(seed))
        self._rng = random.Random(seed + 1)
        # The engine's own variation: each request holds its slot service_time x U(1 - j, 1 + j).
        self._service_jitter = service_jitter
        self._engine_rng = random.Random(seed + 2)
        # One budget per class client, as the load generator's clients share theirs.
        self._budget = RetryBudget(ratio=1.0, min_per_second=2.0, ttl=scenario.deadline, clock=self.clock)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._calls: list[ModelCall] = []
        self._by_ticket: dict[int, ModelCall] = {}
        self._retry_times: list[float] = []
        self._busy: list[tuple[float, float]] = []  # (admitted, released) of every slot held

    def run(self) -> ModelResult:
        for arrival in self.arrivals:
            self._at(arrival.at, functools.partial(self._begin, arrival))
        while self._events:
            when, _, action = heapq.heappop(self._events)
            self.clock.now = max(self.clock.now, when)
            action()
        # Nothing may be left hanging: every call ended, every slot and queue place came back.
        pending = [c for c in self._calls if c.outcome == "pending"]
        if pending or self.controller.in_flight() or self.controller.queued():
            raise AssertionError(
                f"{len(pending)} calls unresolved, {self.controller.in_flight()} in flight, "
                f"{self.controller.queued()} queued at the end"
            )
        idle, last = self._idle()
        return ModelResult(
            tuple(self._calls),
            tuple(self._retry_times),
            idle,
            last,
            slots=self.shape.slots,
            idle_while_servable=self._idle_while_servable(),
            useful_tokens=sum(c.tokens for c in self._calls if self.useful(c)),
            capacity_tokens=self.token_rate * (self.scenario.duration + self.scenario.deadline),
            offered_tokens=sum(c.tokens for c in self._calls),
        )

    def useful(self, call: ModelCall) -> bool:
        """Served within its deadline, and an interactive caller that states a TTFT budget
        got its first token within it."""
        if not call.ok:
            return False
        if call.arrival.cls != "interactive" or not self.start_deadline:
            return True
        return call.first_token is not None and call.first_token - call.start <= self.scenario.ttft_budget

    # -- events ------------------------------------------------------------------------------
    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def _begin(self, arrival: Arrival) -> None:
        policy = retry_policy(arrival.cls, self.scenario, start_deadline=self.start_deadline)
        state = RetryState(policy, clock=self.clock, rng=self._rng, budget=self._budget)
        tokens = self.shape.output_tokens if self.lengths is None else self.lengths.draw(self._lengths_rng)
        service = service_of(self.shape, tokens)
        call = ModelCall(arrival, self.clock.now, state, tokens=tokens, service=service)
        self._calls.append(call)
        self._budget.record_request()
        self._attempt(call)

    def _attempt(self, call: ModelCall) -> None:
        if call.attempts:
            self._retry_times.append(self.clock.now)
        call.attempt_at = self.clock.now
        left = call.state.time_to_start()
        assert left is not None  # every caller has a deadline
        budget = max(1, int(max(left, 0.001) * 1000)) / 1000
        request = AdmissionRequest(
            call.arrival.cls,
            budget=budget,
            stream=True,
            retry=len(call.attempts),
            max_tokens=call.tokens,
            budget_to_start=call.state.start_bound,
        )
        decision = self.controller.submit(request)
        moved = self.controller.take_moved()
        if moved is not None:
            self._apply(moved)
        if isinstance(decision, Rejection):
            call.attempts.append("refused")
            self._refused(call, decision)
            return
        call.ticket = decision
        self._by_ticket[decision.id] = call
        if decision.state is TicketState.ADMITTED:
            call.attempts.append("admitted")
            self._serve(call)
            return
        call.attempts.append("queued")
        ticket = decision
        # The shim's timer at the ticket's deadline (a no-op if it left the queue before).
        self._at(ticket.deadline, lambda: self._expire(ticket))
        # The caller's own timeout while queued: it hangs up at its start budget.
        self._at(self.clock.now + left, lambda: self._hang_up(call, ticket))
        self._apply(self.controller.recheck())

    def _refused(self, call: ModelCall, rejection: Rejection) -> None:
        call.refusal_times.append(self.clock.now - call.attempt_at)
        if call.attempts[-1] == "queued":
            call.attempts[-1] = "queued, refused"
        hint = max(1, round(rejection.retry_after * 1000)) / 1000  # retry-after-ms, as rendered
        decision = call.state.decide(_REFUSED, attempt_started=call.attempt_at, status=429, hint=hint)
        if isinstance(decision, GiveUp):
            self._finish(call, "gave up")
            return
        self._at(self.clock.now + decision.wait, lambda: self._attempt(call))

    def _serve(self, call: ModelCall) -> None:
        ticket = call.ticket
        assert ticket is not None
        assert ticket.admitted_at is not None
        start = ticket.admitted_at
        deadline = call.start + self.scenario.deadline
        first_token = start + self.shape.ttft
        if first_token <= deadline:
            call.first_token = first_token
            # The shim measures each stream's first body byte after admission, as its relay does.
            self._at(first_token, lambda: self.controller.estimator.observe_first_byte(self.shape.ttft))
        spread = self._service_jitter
        end = start + call.service * (1 + self._engine_rng.uniform(-spread, spread))
        if end <= deadline:
            self._at(end, lambda: self._release(call, Outcome.COMPLETED, "ok"))
        else:  # the SDK's deadline cuts the stream; the engine's work for it is lost
            self._at(deadline, lambda: self._release(call, Outcome.ABORTED, "deadline"))

    def _release(self, call: ModelCall, outcome: Outcome, how: str) -> None:
        ticket = call.ticket
        assert ticket is not None
        assert ticket.admitted_at is not None
        self._busy.append((ticket.admitted_at, self.clock.now))
        self._finish(call, how)
        self._apply(self.controller.release(ticket, outcome))

    def _expire(self, ticket: Ticket) -> None:
        rejection = self.controller.expire(ticket)
        if rejection is not None:
            self._refused(self._by_ticket[ticket.id], rejection)

    def _hang_up(self, call: ModelCall, ticket: Ticket) -> None:
        if ticket.state is TicketState.QUEUED and call.ticket is ticket:
            self._apply(self.controller.cancel(ticket))
            self._finish(call, "deadline")

    def _apply(self, dispatch: Dispatch) -> None:
        for ticket in dispatch.admitted:
            self._serve(self._by_ticket[ticket.id])
        for ticket in dispatch.expired:
            assert ticket.rejection is not None
            self._refused(self._by_ticket[ticket.id], ticket.rejection)

    def _finish(self, call: ModelCall, outcome: str) -> None:
        call.outcome = outcome
        call.end = self.clock.now

    def _idle_while_servable(self) -> float:
        """See :attr:`ModelResult.idle_while_servable`: one sweep over the slots' and callers' changes."""
        changes: list[tuple[float, int, int]] = []  # (when, free slots +-, servable callers +-)
        for start, end in self._busy:
            changes += [(start, -1, 0), (end, 1, 0)]
        scenario = self.scenario
        for call in self._calls:
            ticket = call.ticket
            admitted = None if ticket is None else ticket.admitted_at
            waited_to = admitted if admitted is not None else call.end
            assert waited_to is not None  # every call ended (run checks)
            last = call.start + scenario.deadline - call.service
            if call.arrival.cls == "interactive" and self.start_deadline:
                last = min(last, call.start + scenario.ttft_budget - self.shape.ttft)
            until = min(waited_to, last)
            if until > call.start:
                changes += [(call.start, 0, 1), (until, 0, -1)]
        changes.sort()
        free, waiting, idle, before = self.shape.slots, 0, 0.0, 0.0
        for when, slots, callers in changes:
            idle += min(max(free, 0), waiting) * (when - before)
            free, waiting, before = free + slots, waiting + callers, when
        return idle

    def _idle(self) -> tuple[float, float]:
        """Slot-seconds no request held, up to the last completion."""
        if not self._busy:
            return 0.0, 0.0
        last = max(end for _, end in self._busy)
        held = sum(end - start for start, end in self._busy)
        return self.shape.slots * last - held, last


# -- the oracle ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One request as the oracle sees it: when it arrived, its tokens and slot time, and the
    latest moment it may start and still be useful."""

    arrived: float
    tokens: int
    service: float
    latest_start: float
    cls: str


@dataclass(frozen=True)
class OracleResult:
    useful_tokens: int
    served: int
    served_by_class: dict[str, int]
    offered_by_class: dict[str, int]
    busy_slot_seconds: float


def job(
    arrived: float,
    tokens: int,
    cls: str,
    *,
    ttft: float,
    itl: float,
    deadline: float,
    ttft_budget: float | None,
) -> Job:
    """A request of ``cls``: useful when it ends within ``deadline`` of its arrival and, with a
    ``ttft_budget``, its first token (``ttft`` after it starts) comes within that budget."""
    service = ttft + (tokens - 1) * itl
    latest = arrived + deadline - service
    if ttft_budget is not None:
        latest = min(latest, arrived + ttft_budget - ttft)
    return Job(arrived, tokens, service, latest, cls)


def schedule(jobs: Sequence[Job], slots: int, *, classes_first: Sequence[str] = ()) -> OracleResult:
    """Greedy EDF on the latest useful start (see the module docstring) over ``slots`` slots;
    ``classes_first``: strict priority, these classes in this order before the rest (EDF within a
    class): the most of the first class's calls any scheduler serves usefully, and what is left."""
    if slots < 1:
        raise ValueError("slots must be >= 1")
    pending = sorted(jobs, key=lambda j: j.arrived)
    rank = {cls: i for i, cls in enumerate(classes_first)}
    free: list[float] = [0.0] * slots  # when each slot is next free (a heap)
    ready: list[tuple[int, float, int, Job]] = []  # (class rank, latest start, order, job)
    offered: dict[str, int] = {}
    served: dict[str, int] = {}
    for j in pending:
        offered[j.cls] = offered.get(j.cls, 0) + 1
    useful = count = 0
    busy = 0.0
    i = 0
    while i < len(pending) or ready:
        t = free[0]
        while i < len(pending) and pending[i].arrived <= t:
            arrived = pending[i]
            heapq.heappush(ready, (rank.get(arrived.cls, len(rank)), arrived.latest_start, i, arrived))
            i += 1
        chosen: Job | None = None
        while ready and chosen is None:
            candidate = heapq.heappop(ready)[3]
            if candidate.latest_start >= t:
                chosen = candidate  # else: can no longer be served usefully, dropped, never started late
        if chosen is None:
            if i >= len(pending):
                break
            heapq.heapreplace(free, max(t, pending[i].arrived))  # idle until the next arrival
            continue
        heapq.heapreplace(free, t + chosen.service)
        useful += chosen.tokens
        count += 1
        busy += chosen.service
        served[chosen.cls] = served.get(chosen.cls, 0) + 1
    return OracleResult(useful, count, served, offered, busy)


# -- the overload scenarios ----------------------------------------------------------------------


def scenarios() -> list[Scenario]:
    """A burst of 200 judged by success within a 30 s deadline (stating no start deadline: the engine
    starts ~67 in 10 s), and 2x and 1.2x the engine's capacity for 30 s."""
    return [
        Scenario(
            "burst", burst=200, rate_factor=0, duration=0, deadline=30, ttft_budget=10, start_deadline=False
        ),
        Scenario("poisson-2x", burst=0, rate_factor=2.0, duration=30, deadline=30, ttft_budget=10),
        Scenario("poisson-1.2x", burst=0, rate_factor=1.2, duration=30, deadline=30, ttft_budget=10),
    ]


def varied_scenarios(shape: EngineShape, lengths: OutputLengths) -> list[tuple[Scenario, list[str]]]:
    """2x capacity for 30 s, 70 % interactive callers that must begin within 5 s, a 20 s deadline;
    behind the demo's sizing, and behind a sizing like ``calibrate``'s (5 queue places, a queue
    wait of one mean service time)."""
    scenario = Scenario("varied-2x", burst=0, rate_factor=2.0, duration=30, deadline=20, ttft_budget=5)
    mean = f"{service_of(shape, 1) + (lengths.mean() - 1) * shape.itl:.2f}"
    calibrated = ["--max-concurrency", str(shape.slots), "--max-queue", "5"]
    calibrated += ["--max-queue-wait", mean, "--initial-service-time", mean]
    small = dataclasses.replace(scenario, name="varied-2x-small-queue")
    return [(scenario, shim_flags(shape, scenario, hold_batch=False)), (small, calibrated)]


OVERLOAD_HEADER = (
    "scenario | served within deadline | fewest in a run | interactive served | attempts per call | "
    "first retry admitted | largest retry wave | worst interactive TTFT p99 | idle slot-s per run | "
    "refusals after a wait | refused at once | refusal time p90 | useful tokens | "
    "idle while a caller could be served (median) | useful / capacity (median)"
)


def summarize(scenario: Scenario, results: Sequence[ModelResult]) -> list[str]:
    calls = sum(len(r.calls) for r in results)
    ok = sum(r.successes for r in results)
    interactive = sum(sum(c.ok for c in r.calls if c.arrival.cls == "interactive") for r in results)
    admitted = sum(r.first_retry_admitted[0] for r in results)
    retried = sum(r.first_retry_admitted[1] for r in results)
    p99s = [p for r in results if (p := r.ttft_p99()) is not None]
    idle = [r.idle_while_servable_share for r in results]
    refusals = [t for r in results for c in r.calls for t in c.refusal_times]
    p90 = percentile(refusals, 90)
    return [
        scenario.name + ("" if scenario.start_deadline else " (no start deadline)"),
        f"{ok}/{calls} = {ok / calls:.1%}",
        str(min(r.successes for r in results)),
        str(interactive),
        f"{sum(r.attempts for r in results) / calls:.2f}",
        f"{admitted / retried:.1%}" if retried else "-",
        str(max(r.largest_retry_wave for r in results)),
        f"{max(p99s):.2f} s" if p99s else "-",
        f"{sum(r.idle_slot_seconds for r in results) / len(results):.1f}",
        f"{sum(len(r.refused_after_a_wait) for r in results)} of {len(refusals)}",
        str(sum(t == 0 for t in refusals)),
        "-" if p90 is None else f"{p90:.2f} s",
        str(sum(r.useful_tokens for r in results)),
        f"{statistics.median(idle):.1%} (max {max(idle):.1%})",
        f"{statistics.median(r.useful_share for r in results):.2f}",
    ]


def run_overload(args: argparse.Namespace, seeds: list[int]) -> None:
    lengths = None
    if args.lengths:
        median, sigma, cap = args.lengths.split(",")
        lengths = OutputLengths(float(median), float(sigma), int(cap))
    shape = EngineShape()
    chosen = [(s, shim_flags(shape, s, hold_batch=False)) for s in [*scenarios(), demo_scenario(quick=False)]]
    if lengths is not None:
        chosen += varied_scenarios(shape, lengths)
    extra = shlex.split(args.shim_flags)
    chosen = [(s, [*flags, *extra]) for s, flags in chosen]
    if args.only:
        chosen = [(s, f) for s, f in chosen if s.name in set(args.only.split(","))]
    rows = []
    started = time.monotonic()
    for scenario, sizing in chosen:
        results = []
        for seed in seeds:
            model = OverloadModel(
                scenario, shape, sizing, seed=seed, service_jitter=args.service_jitter, lengths=lengths
            )
            results.append(model.run())
            print(f"\r{scenario.name}: seed {seed}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        rows.append(summarize(scenario, results))
    print(f"{len(seeds)} seeds per scenario, {time.monotonic() - started:.1f} s\n")
    print(f"| {OVERLOAD_HEADER} |")
    print("|---|" + "---:|" * OVERLOAD_HEADER.count("|"))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="30", help="a count N (seeds 1..N) or a comma-separated list")
    p.add_argument("--service-jitter", type=float, default=0.0, help="service time x U(1 - j, 1 + j)")
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    lengths = "output tokens per call from a lognormal (e.g. 20,0.8,160), asked as max_tokens with "
    lengths += "ignore_eos; adds the varied-2x scenarios (default: every call the shape's 20 tokens)"
    p.add_argument("--lengths", default="", metavar="MEDIAN,SIGMA,CAP", help=lengths)
    extra = 'shim flags added to every scenario\'s, in one string (e.g. "--max-queue 16")'
    p.add_argument("--shim-flags", default="", metavar="FLAGS", help=extra)
    args = p.parse_args(argv)
    if not 0 <= args.service_jitter < 1:
        p.error("--service-jitter must be in [0, 1)")
    listed = [int(s) for s in args.seeds.split(",") if s]
    run_overload(args, listed if "," in args.seeds else list(range(1, int(args.seeds) + 1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
