"""The admission decision: who goes upstream now, who waits, who is turned away.

(Over 400 lines: the controller is also the read-only :class:`~llm_backoff_shim.decide.view.AdmissionView`
gates and schedulers read, a third of it; every part that stands alone has its own module, below.)

Pure and synchronous: no asyncio, no sockets; time comes from an injected clock.
The asyncio edge (:mod:`llm_backoff_shim.serve.request_path.waiting`) turns the tickets this controller
hands out into awaitables and calls back on completion, disconnect and timeout.

:class:`AdmissionController` is a thin shell around small collaborators, each with its module:

- :class:`~llm_backoff_shim.decide.queues.ClassQueues`: one bounded queue per traffic
  class, highest priority first, standing in one serve order, tenants taking turns within a
  class, with places kept for returning callers;
- a :class:`~llm_backoff_shim.decide.limit.ConcurrencyLimit` caps requests in flight, an
  optional :class:`~llm_backoff_shim.decide.token_budget.TokenBudget` caps their cost
  (KV-cache tokens: prompt plus the answer expected, priced by
  :class:`~llm_backoff_shim.decide.pricing.Pricing` from the answers seen), and
  :class:`~llm_backoff_shim.decide.slots.HeldSlots` counts them, their cost, and keeps when
  each was admitted;
- a :class:`~llm_backoff_shim.decide.scheduler.ClassScheduler` picks the class whose head is
  admitted when a slot frees (default strict priority; the shim's reserved and minimum shares,
  :mod:`llm_backoff_shim.decide.classes`, plug in here);
- :class:`~llm_backoff_shim.decide.view.AdmissionGate` checks run before a request may queue
  (SLO shedding, tenant quotas, engine saturation plug in here) and may refuse it with their
  own code;
- :class:`~llm_backoff_shim.decide.waits.QueueWaits` estimates a request's wait from its place;
- :class:`~llm_backoff_shim.decide.placement.Placement` places a newcomer where it makes no
  queued request late, refuses at arrival one that cannot be served in time, and finds the
  queued requests the estimate has since made late (:meth:`AdmissionController.recheck`);
- :class:`~llm_backoff_shim.decide.refusals.Refusals` builds every refusal and its Retry-After.

The controller keeps what holds a slot, feeds completions to the estimator and the limit, and
drops at the pump a queued request whose wait or budget ran out, or whose remaining budget no
longer covers the service it needs: the engine would only do work its own deadline cuts.

With a cost budget, the class the scheduler picks is served only when its queue head fits the
budget (:meth:`TokenBudget.fits`) beside the cost its own class and the classes above it hold
in flight: the lowest class (batch) counts everything in flight, the highest (interactive)
only its own. Long prompts of a lower class then wait while the budget is taken, by anyone,
and never hold it against chat: a chat is refused a slot only by chat's own cost (or the
count cap), so it keeps the engine's free sequences filled while long prompts queue. Measured
on the real vLLM with chat beside long prompts (docs/benchmarks.md as of 00573c6,
'Long prompts beside chat'): with every class counting all the cost, two long prompts in
flight held the budget, chat queued and was refused at the shim while the engine ran 5 of its 8 sequences. The
price: the cost in flight may pass the budget by what the higher classes hold (at most the
budget each), so the budget bounds what the lowest class may add, not the engine's KV cache
(the engine's own saturation gate, ``--max-kv-cache``, watches that). And a lower class is held
to the budget only while a class above it has requests queued or in flight: the budget keeps the
engine quick for those, and with none there is nobody to keep it quick for, so long prompts fill
the slots (the count cap and the reserved shares still hold). Held to it with nobody above, the
tail of a chat peak on the real vLLM ran 2-3 long prompts on 8 sequences for 20 s with 12-23
queued, the engine's slots idle a third of the time while callers waited. A chat arriving then
counts its own class's cost and takes a free slot; the long prompts behind it wait for the cost
in flight to drain below the budget again.
Nothing behind a head that does not fit in its class passes
it: first come, first served holds within a class at admission as in placement, so a cheap
request does not pass a queued expensive one, which would otherwise wait for as long as
cheap ones keep the budget full (starved, not just late). What the other classes may do
meanwhile depends on the blocked class's requests in flight:

- it has some: it is being served, and its head will fit as they end; the scheduler is asked
  again among the other classes, so interactive chat keeps flowing past a queue of long batch
  prompts while one of them runs (even while batch is below its guaranteed minimum share,
  which counts requests, not their cost);
- it has none: its head holds the budget that frees for itself, and nobody is admitted until
  it fits (in the end, alone). Without this a long prompt could wait for as long as cheaper
  requests of other classes keep the budget full. The price is head-of-line blocking,
  bounded by the drain of what is in flight, once per such head.

Invariant kept by :meth:`AdmissionController._pump`: after every call, either no queued
request can be admitted (the limit is reached, the scheduler holds the slot back, or the
heads it may pick do not fit the cost budget) or every queue is empty. Every ticket ends in
exactly one of RELEASED, CANCELLED, EXPIRED, so in-flight and queued counts (and the cost in
flight) return to zero whatever the mix of outcomes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from llm_backoff_shim.decide.answer_length import AnswerLengths
from llm_backoff_shim.decide.drain_estimate import DrainEstimator
from llm_backoff_shim.decide.limit import ConcurrencyLimit
from llm_backoff_shim.decide.placement import Placement
from llm_backoff_shim.decide.pricing import Pricing
from llm_backoff_shim.decide.queues import ClassQueues
from llm_backoff_shim.decide.refusals import Refusals
from llm_backoff_shim.decide.requests import AdmissionRequest, ClassPolicy, UnknownClassError
from llm_backoff_shim.decide.scheduler import ClassScheduler, MinimumShares, StrictPriority
from llm_backoff_shim.decide.slots import HeldSlots
from llm_backoff_shim.decide.tickets import Dispatch, Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.decide.token_budget import TokenBudget
from llm_backoff_shim.decide.view import AdmissionGate, ClassOutlook
from llm_backoff_shim.decide.waits import QueueWaits, short_of

#: Outcomes whose slot time and answer the estimates learn from (:class:`Outcome`).
_SERVED = frozenset((Outcome.COMPLETED, Outcome.ENDED_BY_CLIENT))

Clock = Callable[[], float]


class AdmissionController:
    """Per-class bounded FIFO queues in front of a concurrency limit (see module docstring)."""

    def __init__(
        self,
        policies: Sequence[ClassPolicy],
        *,
        limit: ConcurrencyLimit,
        estimator: DrainEstimator,
        clock: Clock,
        max_queue_total: int | None = None,
        default_class: str | None = None,
        scheduler: ClassScheduler | None = None,
        gates: Iterable[AdmissionGate] = (),
        returning_share: float = 0.25,
        returning_first: bool = True,
        promise_slack: float = 0.1,
        token_budget: TokenBudget | None = None,
    ) -> None:
        if not policies:
            raise ValueError("at least one traffic class is needed")
        names = [p.name for p in policies]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate class names: {names}")
        self._policies = {p.name: p for p in policies}
        self._classes = tuple(names)
        self._default = names[0] if default_class is None else default_class
        if self._default not in self._policies:
            raise ValueError(f"default class {self._default!r} is not one of {names}")
        if max_queue_total is not None and max_queue_total < 0:
            raise ValueError("max_queue_total must be >= 0")
        if not 0.0 <= returning_share <= 1.0:
            raise ValueError("returning_share must be between 0 and 1")
        if not 0.0 <= promise_slack < 1.0:
            raise ValueError("promise_slack must be at least 0 and below 1")
        # Off: every request is fresh (one FIFO per class, no places kept).
        self._returning_first = returning_first
        self._limit = limit
        self._budget = token_budget
        #: This engine's answer lengths per class, learned from the answers released: what the
        #: cost budget prices an answer at, and how long a lent slot is expected to be held.
        self.answers = AnswerLengths(names, clock)
        #: What the budget counts for a request (None without a budget: nothing is priced).
        self.pricing = (
            None
            if token_budget is None
            else Pricing(token_budget, names, clock, lambda: self._limit.limit, self.answers)
        )
        # The classes whose cost a request of each class counts against the budget: its own
        # and those above it (module docstring); the lowest class counts every class's.
        self._at_or_above = {c: self._classes[: i + 1] for i, c in enumerate(self._classes)}
        self._lowest = self._classes[-1]
        self._estimator = estimator
        self._clock = clock
        self._scheduler: ClassScheduler = scheduler or StrictPriority()
        self.gates: list[AdmissionGate] = list(gates)
        self._held = HeldSlots(names)
        self._queues = ClassQueues(
            self._policies,
            estimator,
            limit,
            max_total=max_queue_total,
            returning_share=returning_share,
            returning_first=returning_first,
        )
        shares = self._scheduler
        self._due_after = shares.due_after if isinstance(shares, MinimumShares) else 0.0
        waits = QueueWaits(
            self._classes,
            shares,
            estimator,
            limit,
            self._held.admitted,
            share_due_in=self.share_due_in,
            served_by_share=self._held.ahead_of_higher,
        )
        self._placement = Placement(self._queues, waits, estimator, promise_slack=promise_slack)
        places_of = None if token_budget is None else self._places
        self._refusals = Refusals(self._queues, waits, estimator, limit, places_of)
        # When each class last saw a fresh arrival (ClassOutlook.fresh_recently).
        self._last_fresh: dict[str, float] = {}
        self._moved: Dispatch | None = None  # see take_moved
        self._offer: AdmissionRequest | None = None  # a newcomer offered a free slot (next_run)
        self._overtaken_total = 0
        self._ids = itertools.count(1)

    # -- view ------------------------------------------------------------------------------
    @property
    def classes(self) -> tuple[str, ...]:
        return self._classes

    @property
    def default_class(self) -> str:
        return self._default

    @property
    def limit(self) -> int:
        return self._limit.limit

    @property
    def token_budget(self) -> int | None:
        """The cost budget in KV-cache tokens; None without one (the count cap alone)."""
        return None if self._budget is None else self._budget.tokens

    def in_flight_tokens(self, cls: str | None = None) -> int:
        """Cost of the requests holding a slot (of ``cls``, or of every class), in KV-cache
        tokens (0 without a cost budget unless the requests were priced anyway)."""
        held = self._held
        return held.tokens if cls is None else held.tokens_per_class[cls]

    @property
    def estimator(self) -> DrainEstimator:
        return self._estimator

    @property
    def scheduler(self) -> ClassScheduler:
        return self._scheduler

    def now(self) -> float:
        return self._clock()

    def policy(self, cls: str) -> ClassPolicy:
        return self._policies[cls]

    def in_flight(self, cls: str | None = None) -> int:
        return self._held.total if cls is None else self._held.per_class[cls]

    def saturated(self) -> bool:
        """Every slot of the current limit is taken."""
        return self._held.total >= self._limit.limit

    def queued(self, cls: str | None = None) -> int:
        if cls is None:
            return self._queues.total
        return len(self._queues.lists[cls])

    def outlook(self, cls: str) -> ClassOutlook:
        """What the shim knows of the requests of ``cls`` to come (see :class:`ClassOutlook`)."""
        estimator = self._estimator
        now = self._clock()
        service = estimator.service_time
        fresh = now - self._last_fresh.get(cls, -math.inf) <= service
        promised = estimator.promises.outstanding(cls)
        if not promised:
            return ClassOutlook(0, 0, fresh)
        return ClassOutlook(
            promised, estimator.promises.promised_within((cls,), -math.inf, now + service), fresh
        )

    def next_run(self, cls: str) -> float | None:
        """Seconds the request of ``cls`` that would take the next slot (its queue's head, or the
        newcomer offered a free slot) is expected to hold it: its :meth:`expected_answer` at the
        measured token rate (:meth:`DrainEstimator.run_time`). None when there is none, nothing
        tells how long its answer will be, or no token rate was measured yet."""
        offer = self._offer
        queue = self._queues.lists[cls]
        if offer is not None and offer.cls == cls:
            request = offer
        elif queue:
            request = queue[0].request
        else:
            return None
        return self._estimator.run_time(self.expected_answer(request))

    def expected_answer(self, request: AdmissionRequest) -> int | None:
        """The answer tokens ``request`` is expected to take: its class's recent answers (else
        every class's) as :class:`AnswerLengths` prices them, capped by its ``max_tokens``; its
        ``max_tokens`` while nothing was learned; None when neither is known. Not ``max_tokens``
        alone: clients set it high (4096) or leave it out, and so priced no answer ever fits."""
        if self.answers.learned_for(request.cls) is None:
            return request.max_tokens
        return self.answers.expected(request.cls, request.max_tokens, 0)

    def head_waited(self, cls: str) -> float:
        """Share of its queue wait (arrival to deadline) the head of ``cls``'s queue has spent:
        0 for an empty queue, 1 at its deadline."""
        queue = self._queues.lists[cls]
        if not queue:
            return 0.0
        head = queue[0]
        window = head.deadline - head.arrived
        return 1.0 if window <= 0 else (self._clock() - head.arrived) / window

    def share_due_in(self, cls: str) -> float:
        """Seconds before ``cls``'s minimum share is due to serve its queue's head (0: due now),
        for the scheduler (:meth:`AdmissionView.share_due_in`) and the wait estimates
        (:class:`QueueWaits`).

        Due at the head's latest start by the estimate: its deadline less the time the share
        takes to serve it (a service time per queue place it stands for, as the wait estimate
        counts it) and one service time more for the estimate's error; never before it has
        spent the scheduler's ``due_after`` of its wait, and at ``due_after`` on the prior alone
        (nothing measured). For an empty queue, as for a one-place head arriving now.

        Why not at ``due_after`` alone (:mod:`llm_backoff_shim.decide.classes`): the share counts
        requests, and the long prompt it admits costs the engine many chats' work (its prefill
        stalls every decode step, its KV cache slows each one); taken once half of a 15 s wait
        was spent, long prompts ran through a chat peak their own deadline let them wait out.
        """
        due_after = self._due_after
        if due_after <= 0:
            return 0.0
        queue = self._queues.lists[cls]
        now = self._clock()
        if queue:
            head = queue[0]
            start, window, places = head.arrived, head.deadline - head.arrived, head.places
        else:
            start, window, places = now, self._policies[cls].max_queue_wait, 1
        spent = due_after * window
        estimator = self._estimator
        if estimator.samples:
            # Every class's service time, not the class's own: a long prompt's own service
            # makes its share due earlier, and long prompts then run through the chat peaks
            # they could have waited out (bench_admission_model.py --mode mix).
            spent = max(spent, window - (places + 1) * estimator.service_time)
        return max(0.0, start + spent - now)

    def queued_returning(self, cls: str) -> int:
        """Queued requests of ``cls`` that said they are retries (and count as returning)."""
        return self._queues.returning(cls)

    def oldest_wait(self, cls: str) -> float:
        """Seconds the longest-waiting request of ``cls``'s queue has waited (0 when empty)."""
        arrived = self._queues.oldest_arrival(cls)
        return 0.0 if arrived is None else max(0.0, self._clock() - arrived)

    def serve_order(self) -> list[Ticket]:
        """The queued tickets of every class, in the order strict priority would admit them."""
        return self._queues.serve_order()

    @property
    def overtaken_total(self) -> int:
        """Queued requests :meth:`recheck` turned away since start (the estimator was wrong)."""
        return self._overtaken_total

    def ahead_of(self, cls: str) -> int:
        """Requests that would be served before a fresh newcomer of ``cls`` (strict-priority view)."""
        return self._queues.ahead_of(cls)

    def fresh_room(self, bound: int, classes: Iterable[str]) -> int:
        """Places of a queue bound that fresh arrivals may fill (:meth:`ClassQueues.fresh_room`)."""
        return self._queues.fresh_room(bound, classes)

    def parse_class(self, header: str | None) -> str:
        """Map an ``x-request-class`` value to a class; absent/blank -> the default class."""
        if header is None or not header.strip():
            return self._default
        name = header.strip().lower()
        if name not in self._policies:
            raise UnknownClassError(header, self._classes)
        return name

    # -- decisions -------------------------------------------------------------------------
    def submit(self, request: AdmissionRequest) -> Ticket | Rejection:
        """Admit (ticket ADMITTED), queue (ticket QUEUED) or refuse a new request."""
        cls = request.cls
        if cls not in self._policies:
            raise UnknownClassError(cls, self._classes)
        refusals = self._refusals
        for gate in self.gates:
            refusal = gate.check(request, self)
            if refusal is not None:
                return refusals.from_gate(cls, refusal)
        if request.budget is not None and request.budget <= 0:
            return refusals.reject(
                cls, "queue_timeout", "request budget (x-request-timeout-ms) already spent"
            )
        now = self._clock()
        if not request.retry:
            self._last_fresh[cls] = now
        wait = self._policies[cls].max_queue_wait
        budget_bound = request.budget is not None and request.budget < wait
        deadline = now + (request.budget if budget_bound and request.budget is not None else wait)
        ticket = Ticket(
            id=next(self._ids), request=request, arrived=now, deadline=deadline, budget_bound=budget_bound
        )
        if self._budget is not None:
            ticket.places = self._places(request)
        if request.retry and self._returning_first and request.budget is not None:
            # A caller promised a return is back: its promise no longer holds a slot ahead of
            # anyone (it is queued, admitted or refused and told a new one).
            self._estimator.promises.redeem(cls)
        queues = self._queues
        # The common case, a slot free and nobody queued: no place to find, nobody to overtake.
        if not queues.total and self._held.total < self._limit.limit and self._fits(request):
            self._offer = request
            try:
                offered = self._scheduler.pick((cls,), self) == cls
            finally:
                self._offer = None
        else:
            offered = False
        if offered:
            if short_of(self._estimator, ticket, now) is not None:
                self._expire(ticket)
                assert ticket.rejection is not None
                return ticket.rejection
            self._held.take(ticket, now)
            return ticket
        returning = ticket.returning = queues.is_returning(request)
        has_room = queues.has_room(cls, returning)
        # A full queue still takes a tenant below its fair share, in another's place (queues.py).
        displaced = None if has_room else queues.displaced_by(request)
        has_room = has_room or displaced is not None
        if not has_room and self.saturated():
            # Full, and no slot for the pump to give anyone: refused whatever its place would
            # be, so its place (a walk of the queue) is not worked out.
            ticket.state = TicketState.CANCELLED
            return refusals.reject(
                cls,
                "queue_full",
                "server at capacity (queue full)",
                request.budget,
                request,
            )
        ahead, in_class = self._placement.place(ticket, now)
        # Queued tentatively even when full: the pump admits it at once if a slot is
        # usable (e.g. --max-queue 0 with an idle engine), else it is taken back out.
        queues.insert(ticket)
        moved = self._pump()
        if any(t is not ticket for t in (*moved.admitted, *moved.expired)):
            # Others moved too: a slot became usable since the last decision (a reservation
            # lent as time passed). Kept for the caller of submit to resolve (take_moved).
            pending = self._moved = self._moved or Dispatch()
            pending.admitted += [t for t in moved.admitted if t is not ticket]
            pending.expired += [t for t in moved.expired if t is not ticket]
        if ticket.state is TicketState.ADMITTED:
            return ticket
        if ticket.state is TicketState.EXPIRED:
            # A free slot, but the budget cannot cover the expected service (see _pump).
            assert ticket.rejection is not None
            return ticket.rejection
        if not has_room:
            queues.remove(ticket)
            ticket.state = TicketState.CANCELLED
            return refusals.reject(
                cls,
                "queue_full",
                "server at capacity (queue full)",
                request.budget,
                request,
            )
        early = self._placement.arrival_refusal(ticket, ahead, in_class)
        if early is not None:
            code, why = early
            # The hint and the queue depth are estimated with it still in its place; then it leaves.
            refused = refusals.reject(cls, code, why, request.budget, request)
            queues.remove(ticket)
            ticket.state = TicketState.CANCELLED
            return refused
        if returning:
            queues.take_turn(ticket)
        if displaced is not None and displaced.state is TicketState.QUEUED:
            queues.remove(displaced)
            displaced.state = TicketState.EXPIRED
            displaced.rejection = refusals.reject(
                cls,
                "queue_full",
                "server at capacity (queue full; its place went to a tenant with fewer waiting)",
                displaced.request.budget,
                displaced.request,
            )
            pending = self._moved = self._moved or Dispatch()
            pending.expired.append(displaced)
        return ticket

    def refuse_at_once(self, request: AdmissionRequest) -> Rejection | None:
        """:meth:`submit`'s answer when it can only be a refusal whatever the queue's order: every
        slot taken and no place in the queue for ``request``; None otherwise (nothing done).

        For a caller that decides before it has the whole request (the relay, from the head:
        proxy.py): when this returns None it has changed nothing, and the request is submitted
        later as usual.
        """
        cls = request.cls
        queues = self._queues
        if (
            not self.saturated()
            or cls not in self._policies
            or queues.has_room(cls, queues.is_returning(request))
            or queues.displaced_by(request) is not None
        ):
            return None
        decision = self.submit(request)
        # submit checks the same two conditions, after gates that can only refuse sooner.
        assert isinstance(decision, Rejection), decision
        return decision

    def take_moved(self) -> Dispatch | None:
        """Tickets other than the newcomer that :meth:`submit` admitted or dropped since the last
        call (None: none, the usual case; no Dispatch is built per request for it).

        A submit decides with the clock of now, and some decisions change with time alone (a
        reservation is lent once its class's returns are not due soon, :mod:`classes`), so
        queued requests may move when a newcomer arrives. The caller of :meth:`submit` resolves
        them as it resolves a :meth:`release`'s Dispatch; left unresolved, an admitted ticket
        would hold its slot for a caller that is never told.
        """
        moved, self._moved = self._moved, None
        return moved

    def release(self, ticket: Ticket, outcome: Outcome, answer_tokens: int | None = None) -> Dispatch:
        """Give back the slot of an ADMITTED ticket; returns who moved up. ``answer_tokens``: the
        completion tokens of its answer, when it was relayed (in full, or until the client
        closed it) and could be counted (the cost budget learns answer lengths from them,
        :mod:`~llm_backoff_shim.decide.pricing`, and the token rate, :meth:`DrainEstimator.observe_tokens
        <llm_backoff_shim.decide.drain_estimate.DrainEstimator.observe_tokens>`, counts them
        rather than ``max_tokens``)."""
        if ticket.state is not TicketState.ADMITTED:
            raise ValueError(f"ticket {ticket.id} is {ticket.state.value}, not admitted")
        ticket.state = TicketState.RELEASED
        self._held.give_back(ticket)
        assert ticket.admitted_at is not None
        service_time = self._clock() - ticket.admitted_at
        learned = outcome in _SERVED
        if learned:
            if answer_tokens is not None:
                self.answers.observe(ticket.cls, answer_tokens)
            self._estimator.observe_completion(ticket.cls, service_time)
            tokens = answer_tokens if answer_tokens is not None else ticket.request.max_tokens
            if tokens is not None:
                self._estimator.observe_tokens(tokens, service_time)
        self._limit.on_complete(
            service_time=service_time,
            in_flight=self.in_flight(),
            overloaded=outcome is Outcome.OVERLOADED,
        )
        dispatch = self._pump()
        if self._queues.total and learned:
            # The service-time estimate moved: the waits promised to those queued moved with it.
            dispatch.expired += self.recheck().expired
        return dispatch

    def cancel(self, ticket: Ticket) -> Dispatch:
        """The caller went away: leave the queue, or give back the slot (as ABORTED)."""
        if ticket.state is TicketState.QUEUED:
            self._queues.remove(ticket)
            ticket.state = TicketState.CANCELLED
            return self._pump()
        if ticket.state is TicketState.ADMITTED:
            return self.release(ticket, Outcome.ABORTED)
        return Dispatch()

    def expire(self, ticket: Ticket) -> Rejection | None:
        """The ticket's queue deadline passed: drop it with ``queue_timeout``.

        None when it is no longer queued (admitted in the meantime): the caller proceeds.
        """
        if ticket.state is not TicketState.QUEUED:
            return None
        self._queues.remove(ticket)
        self._expire(ticket)
        assert ticket.rejection is not None
        return ticket.rejection

    def upstream_unavailable(self, cls: str, detail: str, retry_after: float | None = None) -> Rejection:
        """The refusal for a request whose upstream could not be reached (always 503); its hint is
        ``retry_after`` (the outage's, :class:`~llm_backoff_shim.decide.retry_after.OutageClock`),
        else the shortest."""
        refusal = self._refusals.upstream_unavailable(cls, detail)
        return refusal if retry_after is None else replace(refusal, retry_after=retry_after)

    def overloaded_upstream(self, cls: str, detail: str) -> Rejection:
        """The refusal for a request the engine itself turned away as overloaded (vLLM's 503)."""
        return self._refusals.reject(cls, "queue_full", f"upstream engine at capacity ({detail})")

    def reschedule(self) -> Dispatch:
        """Admit what can go now after a change the controller cannot see (a hold lifted, a limit grew)."""
        return self._pump()

    def recheck(self) -> Dispatch:
        """Turn away queued requests that, from their current place, cannot be served in time.

        The safety net for estimator error: a newcomer is placed where it makes nobody late
        by the estimate (:meth:`submit`), but the estimate moves (the service-time EWMA, time
        passing while slots turn over more slowly than estimated). Those whose expected wait
        now passes their ``max_queue_wait``, or whose remaining budget no longer covers the
        wait plus the time they need once admitted, leave at once with ``queue_timeout`` and a
        Retry-After, rather than at their deadline; each counts in :attr:`overtaken_total`.
        O(queue); never on the cold-start prior.
        """
        dispatch = Dispatch()
        now = self._clock()
        for ticket, why in self._placement.overtaken(now):
            self._queues.remove(ticket)
            ticket.state = TicketState.EXPIRED
            ticket.rejection = self._refusals.overtaken(ticket, why, now)
            dispatch.expired.append(ticket)
        self._overtaken_total += len(dispatch.expired)
        return dispatch

    # -- internals -------------------------------------------------------------------------
    def _pump(self) -> Dispatch:
        dispatch = Dispatch()
        now = self._clock()
        queues = self._queues
        # Classes whose head does not fit the cost budget while some of theirs are in flight.
        blocked: set[str] = set()
        while queues.total and self._held.total < self._limit.limit:
            # In the order their heads are due (see ClassScheduler).
            due = queues.heads_due()
            if blocked:
                due = [c for c in due if c not in blocked]
            cls = self._scheduler.pick(due, self)
            if cls is None:
                break
            ticket = queues.lists[cls][0]
            if ticket.deadline <= now or short_of(self._estimator, ticket, now) is not None:
                # Its wait or the caller's budget ran out, or what is left of the budget cannot
                # cover the service: never send it to the engine.
                queues.pop_head(cls)
                self._expire(ticket)
                dispatch.expired.append(ticket)
                continue
            if not self._fits(ticket.request):
                # It waits for the cost in flight to drain; the others may go meanwhile only
                # while its class has requests in flight (module docstring).
                if self._held.per_class[cls]:
                    blocked.add(cls)
                    continue
                break
            queues.pop_head(cls)
            self._held.take(ticket, now, ahead_of_higher=any(queues.lists[c] for c in queues.above(cls)))
            dispatch.admitted.append(ticket)
        return dispatch

    def _fits(self, request: AdmissionRequest) -> bool:
        """Whether ``request``'s cost fits the cost budget beside what its own class and the
        classes above it hold in flight (always, without a budget; module docstring)."""
        budget = self._budget
        if budget is None:
            return True
        held = self._held
        cls = request.cls
        above = self._at_or_above[cls][:-1]
        if above and not any(held.per_class[c] or self._queues.lists[c] for c in above):
            return True  # nobody above to keep the engine quick for: the count cap alone
        in_flight = held.tokens if cls == self._lowest else held.tokens_of(self._at_or_above[cls])
        return budget.fits(in_flight, request.cost)

    def _places(self, request: AdmissionRequest) -> int:
        """Queue places ``request`` stands for in a wait estimate (:meth:`TokenBudget.places`)."""
        budget = self._budget
        return 1 if budget is None else budget.places(request.cost, self._limit.limit)

    def _expire(self, ticket: Ticket) -> None:
        ticket.state = TicketState.EXPIRED
        ticket.rejection = self._refusals.expired(ticket, self._clock())
