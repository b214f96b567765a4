"""The overload scenarios in virtual time: the shim's real admission decisions against
callers that make ``llm_backoff``'s real retry decisions, on an engine with a fixed
service time and no network.

Why: a real run of the burst of 200 (``bench/bench_overload.py``) takes 40 s of wall
time on two cores, and its success count moves by 2-3 between runs of the same code, so
a change to admission worth one or two successes cannot be told from noise without an
hour of runs. Here the same :class:`~llm_backoff_shim.admission.AdmissionController`
(built from the same flags by :func:`~llm_backoff_shim.app.build_controller`) and the
same :class:`~llm_backoff.attempts.RetryState` (the SDK's retry decisions: the hint plus
its jitter, the deadline and start deadline, the retry budget) run on a
:class:`~llm_backoff_shim.testing.ManualClock` moved from event to event: a burst runs in
a fraction of a second, and a seed gives the same run every time.

What it leaves out, on purpose: the network and the processes' own delays (in a real
burst the load generator needs ~0.2 s to send 200 requests), the engine's variation
(every request holds its slot exactly ``shape.service_time``), and the shim's
asyncio edge (:mod:`llm_backoff_shim.waiting`, which this replays step for step: a timer
at each queued ticket's deadline, a recheck after each request queued). So it measures
the admission policy, not the machine; the real benchmark remains the judge of the
numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llm_backoff import RetryBudget
from llm_backoff.attempts import GiveUp, RetryState
from llm_backoff.classify import Verdict
from llm_backoff_shim.admission import (
    AdmissionController,
    AdmissionRequest,
    Dispatch,
    Outcome,
    Rejection,
    Ticket,
    TicketState,
)
from llm_backoff_shim.app import build_controller
from llm_backoff_shim.config import load_settings
from llm_backoff_shim.loadgen import retry_policy
from llm_backoff_shim.scenario import Arrival, EngineShape, Scenario, arrivals
from llm_backoff_shim.testing import ManualClock

_REFUSED = Verdict(True, "429")


@dataclass
class ModelCall:
    """One caller's call: what it sent and what it got, on the virtual clock."""

    arrival: Arrival
    start: float
    state: RetryState
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
    calls: tuple[ModelCall, ...]
    retry_times: tuple[float, ...]
    idle_slot_seconds: float
    last_completion: float

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
        start_deadline: bool | None = None,
        controller: Callable[[ManualClock], AdmissionController] | None = None,
    ) -> None:
        self.scenario = scenario
        self.shape = shape
        self.clock = ManualClock(0.0)
        if controller is None:
            settings = load_settings(["--upstream", "http://127.0.0.1:9", *shim_flags])
            self.controller = build_controller(settings, self.clock)
        else:
            self.controller = controller(self.clock)
        # Whether interactive callers state their TTFT budget: the scenario's choice by default.
        self.start_deadline = scenario.start_deadline if start_deadline is None else start_deadline
        # The load generator's arrivals for this seed (bench_overload seeds its Random alike).
        self.arrivals = arrivals(scenario, shape.capacity, random.Random(seed))
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
        return ModelResult(tuple(self._calls), tuple(self._retry_times), *self._idle())

    # -- events ------------------------------------------------------------------------------
    def _at(self, when: float, action: Callable[[], None]) -> int:
        seq = next(self._seq)
        heapq.heappush(self._events, (when, seq, action))
        return seq

    def _begin(self, arrival: Arrival) -> None:
        policy = retry_policy(arrival.cls, self.scenario, start_deadline=self.start_deadline)
        state = RetryState(policy, clock=self.clock, rng=self._rng, budget=self._budget)
        call = ModelCall(arrival, self.clock.now, state)
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
        request = AdmissionRequest(call.arrival.cls, budget=budget, stream=True, retry=len(call.attempts))
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
        spread = self._service_jitter
        end = start + self.shape.service_time * (1 + self._engine_rng.uniform(-spread, spread))
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

    def _idle(self) -> tuple[float, float]:
        """Slot-seconds no request held, up to the last completion."""
        if not self._busy:
            return 0.0, 0.0
        last = max(end for _, end in self._busy)
        held = sum(end - start for start, end in self._busy)
        return self.shape.slots * last - held, last


def burst_report(results: Sequence[ModelResult]) -> str:
    """Successes over seeds: the spread a policy change must be judged against."""
    counts = Counter(r.successes for r in results)
    spread = ", ".join(f"{n}: {counts[n]}" for n in sorted(counts))
    return f"successes over {len(results)} seeds -> {spread}"
