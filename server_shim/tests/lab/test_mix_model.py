"""A mix of chat beside long prompts, and that mix in virtual time: small, seeded runs.

The model here (:func:`run_mix`): the shim's real admission decisions in front of the
simulator's real engine model (continuous batching, prefill cost, KV cache), no network.

Why: whether the cost budget (``--max-inflight-tokens``) beats the request cap is a question
about the engine behind the shim (a long prompt's prefill slows every decode step it shares,
and holds many times a chat's KV cache), and a wall-clock run on two shared cores measures the
machine as much as the policy. Here the :class:`~llm_backoff_shim.decide.admission.AdmissionController`
the shim builds from its flags (:func:`~llm_backoff_shim.serve.app.build_controller`) runs in
front of a :class:`~llm_backoff_shim.sim.engine.SimEngine` on one
:class:`~llm_backoff_shim.testing.ManualClock`, moved from event to event: a minute of traffic
runs in a second or two, and a seed gives the same run every time.

The callers are open-loop, one attempt each (no retries: a refused call is counted refused):

- a caller with a time-to-first-token budget (chat) sends it as the SDK does
  (``x-request-timeout-ms`` with ``x-request-timeout-scope: start``, streaming) and hangs up
  when its first token has not come within it, at the shim or at the engine (the engine's
  work for it is then wasted);
- a patient caller (long prompts, batch) waits for as long as the shim's queue keeps it.

The shim prices each request from its real prompt text, as it does on the wire
(:class:`~llm_backoff_shim.decide.pricing.Pricing`: the prompt at the bytes per token the
simulator's ``/tokenize`` counts for the shim's sample text, the answer as the answers relayed
so far say); the engine counts the prompt as the simulator does (1.3 tokens a word), so the
estimate's error is in the run. What is left out: the network, the processes' own delays, retries, and the
shim's asyncio edge, which this replays step for step (a timer at each queued ticket's deadline,
a recheck after each request queued, first bytes fed to the estimator).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.cost import SAMPLE_TEXT, estimate_prompt_tokens
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Dispatch, Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.lab.workload import LengthDist, Workload
from llm_backoff_shim.serve.app import build_controller
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.sim.engine import EngineParams, SimEngine
from llm_backoff_shim.sim.engine import Sequence as EngineSequence
from llm_backoff_shim.sim.protocol import estimate_tokens
from llm_backoff_shim.testing import ManualClock

# -- the mix --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixPart:
    """One kind of request in a :class:`Mix`: its share of the calls, its lengths, the traffic
    class it is sent as (``x-request-class``) and, for a caller that waits for its answer to
    begin, its time-to-first-token budget in seconds (None: a patient batch caller)."""

    name: str
    share: float
    workload: Workload
    cls: str
    ttft_budget: float | None = None

    def __post_init__(self) -> None:
        if not (0 < self.share <= 1 and math.isfinite(self.share)):
            raise ValueError(f"{self.name}: share must be in (0, 1], got {self.share!r}")
        if self.ttft_budget is not None and not self.ttft_budget > 0:
            raise ValueError(f"{self.name}: ttft_budget must be > 0")


@dataclass(frozen=True)
class Mix:
    """Several kinds of request in one load, each call drawn as one of them by its share
    (the shares add up to 1). The realistic mix of chat beside long prompts is :data:`CHAT_AND_LONG`."""

    parts: tuple[MixPart, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a mix needs at least one part")
        if abs(sum(p.share for p in self.parts) - 1.0) > 1e-9:
            raise ValueError("the shares of a mix must add up to 1")
        if len({p.name for p in self.parts}) != len(self.parts):
            raise ValueError("the parts of a mix need distinct names")

    def part(self, name: str) -> MixPart:
        for part in self.parts:
            if part.name == name:
                return part
        raise KeyError(name)

    def pick(self, rng: random.Random) -> MixPart:
        """One part, by share (one draw of ``rng``)."""
        x, total = rng.random(), 0.0
        for part in self.parts:
            total += part.share
            if x < total:
                return part
        return self.parts[-1]

    def draw(self, rng: random.Random) -> tuple[MixPart, str, int]:
        """One call: its part, its prompt text and its ``max_tokens``."""
        part = self.pick(rng)
        text, max_tokens = part.workload.draw(rng)
        return part, text, max_tokens

    def describe(self) -> str:
        return "; ".join(
            f"{p.share:.0%} {p.name} ({p.cls}"
            + (f", {p.ttft_budget:g} s TTFT budget" if p.ttft_budget is not None else "")
            + f"): {p.workload.describe()}"
            for p in self.parts
        )


#: Long prompts of retrieval-augmented and agent calls: 1,150-2,300 words, about 1.5-3k tokens
#: by the simulator's count (1.3 a word; the shim's cost estimate says about 1.2 a word).
LONG_PROMPT_WORDS = LengthDist.uniform(1150, 2300)
#: Their answers: lognormal, median 128 tokens, at most 512.
LONG_OUTPUT_TOKENS = LengthDist.lognormal(128, 0.6, 16, 512)

#: 80 % chat (the default lengths, interactive, 5 s TTFT budget) and 20 % long prompts (batch).
CHAT_AND_LONG = Mix(
    (
        MixPart("chat", 0.8, Workload(), "interactive", ttft_budget=5.0),
        MixPart("long", 0.2, Workload(LONG_PROMPT_WORDS, LONG_OUTPUT_TOKENS), "batch"),
    )
)


# -- the model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixArrival:
    """One call: when it comes, what kind, its prompt as the engine counts it, its text, and its
    ``max_tokens`` (generated in full: ``ignore_eos``)."""

    at: float
    part: MixPart
    prompt_tokens: int
    text: str
    max_tokens: int

    def body(self) -> dict[str, object]:
        """The call's request body, as the shim prices it."""
        return {"messages": [{"role": "user", "content": self.text}], "max_tokens": self.max_tokens}


def mix_arrivals(
    mix: Mix,
    rate: float,
    duration: float,
    rng: random.Random,
    *,
    burst: tuple[float, int, MixPart] | None = None,
) -> list[MixArrival]:
    """Poisson arrivals of ``mix`` at ``rate`` calls/s for ``duration`` s, plus an optional
    ``burst``: (at, count, part) calls of that part arriving at once (the part need not be one
    of ``mix``'s: a burst of long prompts on top of chat alone)."""

    def call(at: float, part: MixPart) -> MixArrival:
        text, max_tokens = part.workload.draw(rng)
        return MixArrival(at, part, estimate_tokens(text) + 4, text, max_tokens)

    calls: list[MixArrival] = []
    now = 0.0
    while rate > 0:
        now += rng.expovariate(rate)
        if now >= duration:
            break
        calls.append(call(now, mix.pick(rng)))
    if burst is not None:
        at, count, part = burst
        calls += [call(at, part) for _ in range(count)]
    calls.sort(key=lambda a: a.at)
    return calls


@dataclass
class MixCall:
    """What became of one call."""

    arrival: MixArrival
    request_id: str
    outcome: str = "pending"  # completed | refused | gave_up
    code: str = ""
    first_token: float | None = None
    done: float | None = None
    ticket: Ticket | None = None
    at_engine: bool = False
    wasted: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival.at

    @property
    def useful(self) -> bool:
        """Completed, and within its time-to-first-token budget if it has one."""
        if self.outcome != "completed":
            return False
        budget = self.arrival.part.ttft_budget
        ttft = self.ttft
        return budget is None or (ttft is not None and ttft <= budget)


@dataclass
class MixResult:
    """A run's calls and the engine's time: the figures of the cost-budget comparison."""

    calls: list[MixCall]
    duration: float
    busy: float
    end: float
    wasted_tokens: int
    preemptions: int
    generated_tokens: int
    by_part: dict[str, list[MixCall]] = field(init=False)

    def __post_init__(self) -> None:
        self.by_part = {}
        for call in self.calls:
            self.by_part.setdefault(call.arrival.part.name, []).append(call)

    def count(self, part: str, what: Callable[[MixCall], bool]) -> int:
        return sum(1 for c in self.by_part.get(part, []) if what(c))

    def ttft_quantile(self, part: str, q: float, since: float = -math.inf, until: float = math.inf) -> float:
        """The ``q`` quantile of time to first token over the calls of ``part`` the engine was
        sent (arriving in ``[since, until)``); one that never got its first token (its caller hung
        up) counts as infinite. NaN when there is none."""
        values = sorted(
            math.inf if c.ttft is None else c.ttft
            for c in self.by_part.get(part, [])
            if c.at_engine and since <= c.arrival.at < until
        )
        if not values:
            return math.nan
        return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]

    @property
    def useful_tokens(self) -> int:
        """Output tokens of the calls served within their budget."""
        return sum(c.arrival.max_tokens for c in self.calls if c.useful)

    @property
    def token_rate(self) -> float:
        """Output tokens the engine generated per second, over the whole run (its drain included)."""
        return self.generated_tokens / self.end if self.end > 0 else 0.0

    @property
    def busy_share(self) -> float:
        """Share of the offered window the engine held at least one sequence."""
        return self.busy / self.duration


class MixModel:
    """One run: :meth:`run` plays ``arrivals`` to the end through ``shim_flags`` (None: direct)."""

    def __init__(
        self,
        arrivals: Sequence[MixArrival],
        engine: EngineParams,
        shim_flags: Sequence[str] | None,
        *,
        duration: float,
    ) -> None:
        self.clock = ManualClock(0.0)
        self.engine = SimEngine(engine, self.clock)
        self.controller: AdmissionController | None = None
        if shim_flags is not None:
            settings = load_settings(["--upstream", "http://127.0.0.1:9", *shim_flags])
            self.controller = build_controller(settings, self.clock)
            pricing = self.controller.pricing
            if pricing is not None:
                # The shim's start-up question to the engine's /tokenize (prompt_units.py).
                pricing.learn_ratio(SAMPLE_TEXT, estimate_tokens(SAMPLE_TEXT))
        self.duration = duration
        self.calls = [MixCall(a, f"r{index}") for index, a in enumerate(arrivals)]
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._by_id: dict[str, MixCall] = {}
        self._by_ticket: dict[int, MixCall] = {}
        self._busy = 0.0

    def run(self) -> MixResult:
        for call in self.calls:
            self._at(call.arrival.at, functools.partial(self._arrive, call))
        engine = self.engine
        while True:
            due = engine.next_event_time()
            head = self._events[0][0] if self._events else None
            if due is None and head is None:
                break
            if due is not None and (head is None or due <= head):
                self._advance(due)
                self._tokens(engine.step())
            else:
                when, _, action = heapq.heappop(self._events)
                self._advance(when)
                action()
        pending = [c for c in self.calls if c.outcome == "pending"]
        c = self.controller
        if pending or (c is not None and (c.in_flight() or c.queued())):
            raise AssertionError(f"{len(pending)} calls unresolved at the end")
        return MixResult(
            self.calls,
            self.duration,
            self._busy,
            self.clock.now,
            sum(call.wasted for call in self.calls),
            engine.stats.preemptions,
            engine.stats.tokens_generated,
        )

    # -- events ------------------------------------------------------------------------------
    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def _advance(self, when: float) -> None:
        now = self.clock.now
        if when > now:
            if self.engine.num_running:
                self._busy += max(0.0, min(when, self.duration) - min(now, self.duration))
            self.clock.now = when

    def _arrive(self, call: MixCall) -> None:
        arrival = call.arrival
        budget = arrival.part.ttft_budget
        if budget is not None:
            self._at(arrival.at + budget, lambda: self._give_up(call))
        c = self.controller
        if c is None:
            self._send(call)
            return
        request = AdmissionRequest(
            arrival.part.cls,
            budget=budget,
            stream=budget is not None,
            max_tokens=arrival.max_tokens,
            budget_to_start=budget is not None,
            cost=0 if c.pricing is None else c.pricing.price_body(arrival.part.cls, arrival.body()),
        )
        decision = c.submit(request)
        self._apply(c.take_moved())
        if isinstance(decision, Rejection):
            self._refuse(call, decision.code)
            return
        call.ticket = decision
        self._by_ticket[decision.id] = call
        if decision.state is TicketState.ADMITTED:
            self._send(call)
            return
        self._at(decision.deadline, lambda: self._deadline(call))
        self._apply(c.recheck())

    def _send(self, call: MixCall) -> None:
        self._by_id[call.request_id] = call
        call.at_engine = True
        self.engine.add(
            call.request_id, max_tokens=call.arrival.max_tokens, prompt_tokens=call.arrival.prompt_tokens
        )

    def _apply(self, dispatch: Dispatch | None) -> None:
        if dispatch is None:
            return
        for ticket in dispatch.admitted:
            self._send(self._by_ticket[ticket.id])
        for ticket in dispatch.expired:
            assert ticket.rejection is not None
            self._refuse(self._by_ticket[ticket.id], ticket.rejection.code)

    def _refuse(self, call: MixCall, code: str) -> None:
        call.outcome, call.code, call.done = "refused", code, self.clock.now

    def _deadline(self, call: MixCall) -> None:
        ticket, c = call.ticket, self.controller
        if call.outcome != "pending" or ticket is None or c is None:
            return
        rejection = c.expire(ticket)
        if rejection is not None:
            self._refuse(call, rejection.code)

    def _give_up(self, call: MixCall) -> None:
        """A caller whose first token has not come within its budget hangs up."""
        if call.outcome != "pending" or call.first_token is not None:
            return
        call.outcome, call.done = "gave_up", self.clock.now
        if call.at_engine:
            seq = self.engine.abort(call.request_id)
            if seq is not None:
                call.wasted = seq.prefilled + seq.generated
        c, ticket = self.controller, call.ticket
        if c is not None and ticket is not None:
            self._apply(c.cancel(ticket))

    def _tokens(self, touched: list[EngineSequence]) -> None:
        now, c = self.clock.now, self.controller
        for seq in touched:
            call = self._by_id[seq.request_id]
            if call.first_token is None:
                call.first_token = now
                ticket = call.ticket
                streamed = call.arrival.part.ttft_budget is not None
                if c is not None and ticket is not None and ticket.admitted_at is not None and streamed:
                    c.estimator.observe_first_byte(now - ticket.admitted_at, ticket.cls)
            if seq.done:
                call.done = now
                if call.outcome == "pending":
                    call.outcome = "completed"
                if c is not None and call.ticket is not None and call.ticket.state is TicketState.ADMITTED:
                    self._apply(c.release(call.ticket, Outcome.COMPLETED, call.arrival.max_tokens))


def run_mix(
    arrivals: Sequence[MixArrival], engine: EngineParams, shim_flags: Sequence[str] | None, duration: float
) -> MixResult:
    """:class:`MixModel` of ``arrivals`` through ``shim_flags`` (None: straight to the engine)."""
    return MixModel(arrivals, engine, shim_flags, duration=duration).run()


# -- the tests -----------------------------------------------------------------------------------

ENGINE = EngineParams(
    max_num_seqs=32,
    ttft=0.05,
    itl=0.02,
    itl_batch_factor=0.01,
    prefill_time_per_token=0.0001,
    kv_cache_tokens=16384,
)
SHIM = ["--classes", "interactive,batch", "--max-queue", "200"]
SHIM += ["--class-max-queue-wait", "interactive=5,batch=60"]


def test_a_mix_draws_its_parts_by_share_and_checks_itself() -> None:
    rng = random.Random(1)
    names = [CHAT_AND_LONG.pick(rng).name for _ in range(2000)]
    assert 0.75 < names.count("chat") / len(names) < 0.85
    part, text, max_tokens = CHAT_AND_LONG.draw(random.Random(2))
    assert part.cls in ("interactive", "batch")
    assert text
    assert max_tokens >= 1
    assert "80% chat (interactive, 5 s TTFT budget)" in CHAT_AND_LONG.describe()
    with pytest.raises(ValueError, match="add up to 1"):
        Mix((MixPart("a", 0.5, Workload(), "interactive"),))
    with pytest.raises(ValueError, match="distinct"):
        Mix((MixPart("a", 0.5, Workload(), "x"), MixPart("a", 0.5, Workload(), "y")))


def test_the_long_prompts_are_priced_from_their_text() -> None:
    arrivals = mix_arrivals(CHAT_AND_LONG, 5.0, 20.0, random.Random(3))
    longs = [a for a in arrivals if a.part.name == "long"]
    chats = [a for a in arrivals if a.part.name == "chat"]
    assert longs
    assert chats
    # 1,150-2,300 words: the engine counts 1.3 a word; the shim estimates from the text.
    assert all(1500 <= a.prompt_tokens <= 3100 for a in longs)
    assert all(a.body()["max_tokens"] == a.max_tokens for a in arrivals)
    assert max(estimate_prompt_tokens(a.body()) for a in chats) < min(
        estimate_prompt_tokens(a.body()) for a in longs
    )


def test_a_burst_of_long_prompts_waits_in_the_shim_under_a_cost_budget() -> None:
    chat = CHAT_AND_LONG.part("chat")
    chat_only = Mix((MixPart("chat", 1.0, chat.workload, chat.cls, chat.ttft_budget),))
    long_ = MixPart("long", 1.0, Workload(LengthDist.fixed(1500), LengthDist.fixed(100)), "batch")
    arrivals = mix_arrivals(chat_only, 4.0, 20.0, random.Random(4), burst=(5.0, 30, long_))
    direct = run_mix(arrivals, ENGINE, None, 20.0)
    capped = run_mix(arrivals, ENGINE, [*SHIM, "--max-concurrency", "32"], 20.0)
    budgeted = [*SHIM, "--max-concurrency", "32", "--max-inflight-tokens", "8000"]
    budget = run_mix(arrivals, ENGINE, budgeted, 20.0)
    chats = len(budget.by_part["chat"])
    ok = [r.count("chat", lambda c: c.useful) for r in (direct, capped, budget)]
    # Straight to the engine or through a request cap sized for chat, the burst makes chat late;
    # with the budget every chat call is served in time and every long prompt is served too.
    assert ok[2] == chats
    assert ok[0] < chats
    assert ok[1] < chats
    assert budget.count("long", lambda c: c.useful) == 30
    assert budget.useful_tokens > max(direct.useful_tokens, capped.useful_tokens)
    for result in (direct, capped, budget):
        assert all(c.outcome != "pending" for c in result.calls)
