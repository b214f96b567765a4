"""The overload scenarios in virtual time: the shim's real admission decisions against
callers that make ``llm_backoff``'s real retry decisions, on an engine with a fixed
service time and no network.

Why: a real run of the burst of 200 (bench/bench_overload.py at 658ce04) takes 40 s of wall
time on two cores, and its success count moves by 2-3 between runs of the same code, so
a change to admission worth one or two successes cannot be told from noise without an
hour of runs. Here the same :class:`~llm_backoff_shim.decide.admission.AdmissionController`
(built from the same flags by :func:`~llm_backoff_shim.serve.app.build_controller`) and the
same :class:`~llm_backoff.attempts.RetryState` (the SDK's retry decisions: the hint plus
its jitter, the deadline and start deadline, the retry budget) run on a
:class:`~llm_backoff_shim.testing.ManualClock` moved from event to event: a burst runs in
a fraction of a second, and a seed gives the same run every time.

What it leaves out, on purpose: the network and the processes' own delays (in a real
burst the load generator needs ~0.2 s to send 200 requests), the engine's variation
unless asked for (by default every request holds its slot exactly ``shape.service_time``;
``service_jitter`` varies it uniformly, and :class:`OutputLengths` draws each call's
output length, asked as ``max_tokens`` with ``ignore_eos``, from a capped lognormal), and the shim's
asyncio edge (:mod:`llm_backoff_shim.serve.request_path.waiting`, which this replays step for step: a timer
at each queued ticket's deadline, a recheck after each request queued). So it measures
the admission policy, not the machine; the real benchmark remains the judge of the
numbers in docs/benchmarks.md. A run returns a
:class:`~llm_backoff_shim.lab.overload_results.ModelResult`.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from llm_backoff import RetryBudget
from llm_backoff.attempts import GiveUp, RetryState
from llm_backoff.classify import Verdict
from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Dispatch, Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.lab.callers import retry_policy
from llm_backoff_shim.lab.overload_results import ModelCall, ModelResult
from llm_backoff_shim.lab.scenario import Arrival, EngineShape, Scenario, arrivals
from llm_backoff_shim.serve.app import build_controller
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.testing import ManualClock

_REFUSED = Verdict(True, "429")


@dataclass(frozen=True)
class OutputLengths:
    """Output tokens per call: a lognormal with this ``median`` and ``sigma``, rounded, in 1..``cap``.

    Each call asks for its length as ``max_tokens`` with ``ignore_eos`` (as the real-engine
    benchmark does), so the shim knows the most it will generate and the engine generates
    exactly that: the call holds its slot ``ttft + (tokens - 1) * itl``.
    """

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
        # Each call's output length: fixed (the shape's), or drawn (its own Random, so that the
        # arrivals of a seed are those of the fixed runs at the same rate factor).
        self.lengths = lengths
        mean_tokens = shape.output_tokens if lengths is None else lengths.mean()
        mean_service = service_of(shape, 1) + (mean_tokens - 1) * shape.itl
        #: Completions per second and tokens per second with every slot busy.
        self.capacity = shape.slots / mean_service
        self.token_rate = self.capacity * mean_tokens
        self._lengths_rng = random.Random(seed + 3)
        # The load generator's arrivals for this seed (bench_overload seeds its Random alike).
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
    def _at(self, when: float, action: Callable[[], None]) -> int:
        seq = next(self._seq)
        heapq.heappush(self._events, (when, seq, action))
        return seq

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
