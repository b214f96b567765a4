"""The admission decision: who goes upstream now, who waits, who is turned away.

Pure and synchronous: no asyncio, no sockets; time comes from an injected clock.
The asyncio edge (:mod:`llm_backoff_shim.waiting`) turns the tickets this controller
hands out into awaitables and calls back on completion, disconnect and timeout.

Model:

- one bounded FIFO queue per traffic class, classes listed highest priority first
  (``interactive`` before ``batch``); ``max_queue_total`` bounds all queues together;
- a :class:`~llm_backoff_shim.limit.ConcurrencyLimit` caps requests in flight;
- a :class:`ClassScheduler` picks the class whose head is admitted when a slot frees
  (default :class:`StrictPriority`; reserved shares / anti-starvation plug in here);
- :class:`AdmissionGate` checks run before a request may queue (SLO shedding, tenant
  quotas, engine saturation plug in here) and may refuse it with their own code.

Early refusals, once a completion was measured (never on the cold-start prior):

- a caller whose remaining budget cannot cover the expected queue wait plus the time
  it needs once admitted (:meth:`DrainEstimator.expected_service`: the whole service, or
  the first token of a stream if so configured) gets ``queue_timeout`` at arrival, and a queued one
  whose remaining budget no longer covers that time is dropped when dequeued: the
  engine would only do work its own deadline cuts;
- a request whose estimated wait (the queued work served before it, higher-priority
  classes included) exceeds its class's ``max_queue_wait`` gets ``queue_full`` at once
  with the estimated Retry-After, instead of holding a queue place for the whole
  wait to be told ``queue_timeout``. ``queue_full``, not ``queue_timeout``: the queue
  is full measured in time, and the caller's own budget played no part.

Returning callers first. A request whose client says it is a retry (``x-stainless-retry-count``
>= 1, :attr:`AdmissionRequest.returning`) and says how long it will wait
(``x-request-timeout-ms``) was most likely told a Retry-After and honoured it;
Retry-After is an estimate, not a reservation, so without help it would find its place
taken by fresh arrivals and be turned away again. So, within its class, a returning request
is served before the fresh ones (where that breaks no promise, below), and while callers
have been promised a return, up to ``returning_share`` of each queue bound (one place per
promise) is kept for returning requests: a full queue refuses a fresh arrival before it
refuses a returning one. A request already queued is never evicted. A fresh arrival's
expected wait counts the callers of its own class and the classes above it already promised
a return before it would be served (:meth:`DrainEstimator.expected_wait`): a promise is a slot
kept for that caller (the estimator paces the promises of all classes on one timeline at the
drain rate), so a fresh arrival is queued only into the slots nobody of its class or above
was promised; a lower class's promise yields to it (that caller is told again on its
return). Anyone can claim to be a retry: the claim buys a place ahead of fresh arrivals of
the same class, nothing more; tenant quotas, budgets and class bounds apply unchanged.
``returning_first=False`` turns the order and the kept places off (every request is fresh;
promised returns still count in a fresh arrival's wait): with short deadlines and clients
that send no budget, retries served first can be served too late (docs/demo.md).

A queued request keeps its promise. All queued requests stand in one serve order, each with
a sort key: by class (highest first), returning before fresh, then arrival. A request is
queued only if its estimated wait at its place is within its class's ``max_queue_wait`` and
its budget (less the service it needs); that is its promise, and a later arrival must not
break it. A newcomer whose natural place is ahead of queued requests (a higher class, or a
returning caller ahead of fresh ones) therefore checks, in one walk of the queue, which of
them one more request ahead would make late by the estimator, or leave with less than
``promise_slack`` of their class's ``max_queue_wait`` in hand for the estimate's error, and
is placed right after the last such request instead (its key extends that request's key),
where it pushes back only requests with room to spare. If its wait at that place is past
its own limit or budget, it is refused at arrival with a spread Retry-After. The
trade-off: while lower-class or fresh requests near their limit are queued, a higher-class
or returning newcomer waits behind them, and is refused at arrival when that wait is too
long for it.
:meth:`AdmissionController.recheck` remains the safety net for estimator error (service
times vary; the estimate moves): it re-estimates every queued request from its place and
turns away, with ``queue_timeout`` and a Retry-After, those that can no longer be served
within their ``max_queue_wait`` or budget, instead of letting them wait it out; each such
refusal counts in :attr:`AdmissionController.overtaken_total`. A class's guaranteed minimum
share (:class:`MinimumShares`, e.g. the shim's scheduler) bounds its wait, so requests the
share will serve in time stay. The schedulers see the classes with queued requests in the
order their heads are due, so a request placed behind a lower class's request waits for it.

Invariant kept by :meth:`AdmissionController._pump`: after every call, either no queued
request can be admitted (the limit is reached or the scheduler holds the slot back)
or every queue is empty. Every ticket ends in exactly one of RELEASED, CANCELLED,
EXPIRED, so in-flight and queued counts return to zero whatever the mix of outcomes.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, runtime_checkable

from llm_backoff_shim.estimator import DrainEstimator
from llm_backoff_shim.limit import ConcurrencyLimit

Clock = Callable[[], float]

RejectCode = Literal["queue_full", "queue_timeout", "slo_shed", "tenant_rate_limited", "upstream_unavailable"]
ErrorType = Literal["server_overloaded", "rate_limit_exceeded"]


class UnknownClassError(ValueError):
    """``x-request-class`` names a class this shim does not serve."""

    def __init__(self, value: str, known: Sequence[str]) -> None:
        super().__init__(f"unknown request class {value!r}; expected one of: {', '.join(known)}")
        self.value = value
        self.known = tuple(known)


@dataclass(frozen=True)
class ClassPolicy:
    """Queue bound and longest queue wait (seconds) of one traffic class."""

    name: str
    max_queue: int
    max_queue_wait: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("class name must not be empty")
        if self.max_queue < 0:
            raise ValueError(f"class {self.name}: max_queue must be >= 0")
        if not (self.max_queue_wait > 0 and math.isfinite(self.max_queue_wait)):
            raise ValueError(f"class {self.name}: max_queue_wait must be a positive finite number")


@dataclass(frozen=True)
class AdmissionRequest:
    """What the decision may look at: the class, the caller's remaining budget (s), a tenant key,
    whether the body asks for a stream (served at the first token rather than at the end),
    how many times the caller says it has retried this call (``x-stainless-retry-count``), and
    the most output tokens the body asks for (``max_tokens`` / ``max_completion_tokens``; None
    when it does not say)."""

    cls: str
    budget: float | None = None
    tenant: str | None = None
    stream: bool = False
    retry: int = 0
    max_tokens: int | None = None

    @property
    def returning(self) -> bool:
        """A caller coming back (after a Retry-After, usually): served before fresh arrivals."""
        return self.retry >= 1


def requested_max_tokens(body: Mapping[str, object]) -> int | None:
    """The most output tokens a request body asks for (``max_completion_tokens``, else
    ``max_tokens``), or None when it names no positive whole number. The engine validates
    the body; this only reads what the admission decision may use."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


#: Larger claimed retry counts are read as this: the number only matters as ">= 1".
MAX_RETRY_COUNT = 1000


def parse_retry_count(value: str | None) -> int:
    """``x-stainless-retry-count`` as a count; absent or malformed is 0 (a fresh arrival).

    The openai SDKs send it (0 on a first attempt, n on the n-th retry) and ``llm_backoff``
    does too. It is a client library's header, not part of this shim's protocol, so a
    value it cannot read is not the client's mistake: no 400, the request is simply fresh.
    """
    if value is None:
        return 0
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 6:
        return 0
    return min(int(text), MAX_RETRY_COUNT)


@dataclass(frozen=True)
class Rejection:
    """A refusal, ready for :mod:`llm_backoff_shim.rejection` to render (docs/protocol.md).

    ``message`` is the reason only; the renderer appends ", retry in N s".
    ``status`` None means the configured ``--reject-status``.
    """

    code: RejectCode
    message: str
    retry_after: float
    queue_depth: int
    type: ErrorType = "server_overloaded"
    status: int | None = None


@dataclass(frozen=True)
class GateRefusal:
    """A gate's "no". Without ``retry_after`` the controller's estimate is used."""

    code: RejectCode
    message: str
    type: ErrorType = "server_overloaded"
    retry_after: float | None = None
    status: int | None = None


class TicketState(enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    RELEASED = "released"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class Outcome(enum.Enum):
    """How an admitted request ended; only COMPLETED (a 2xx relayed in full) feeds the service-time estimate.

    CLIENT_ERROR: the upstream answered 4xx (quick, says nothing about generation time);
    OVERLOADED: the upstream itself refused as overloaded (a signal for adaptive limits).
    """

    COMPLETED = "completed"
    CLIENT_ERROR = "client_error"
    UPSTREAM_ERROR = "upstream_error"
    OVERLOADED = "overloaded"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place: queued, then admitted (holding a slot), then released.

    ``key`` orders the queued tickets of all classes into one serve order (see the module
    docstring); ``returning``: queued in its class's returning lane.
    """

    id: int
    request: AdmissionRequest
    arrived: float
    deadline: float
    budget_bound: bool = False
    state: TicketState = TicketState.QUEUED
    admitted_at: float | None = None
    rejection: Rejection | None = None
    key: tuple[int, ...] = ()
    returning: bool = False

    @property
    def cls(self) -> str:
        return self.request.cls

    @property
    def queue_time(self) -> float:
        """Seconds spent queued (0 when admitted on arrival)."""
        return 0.0 if self.admitted_at is None else self.admitted_at - self.arrived


class ClassOutlook(NamedTuple):
    """The requests of one class the shim can foresee, for schedulers.

    ``promised``: callers told to come back and not back yet; ``due_soon``: those of them due
    within one service time, or already due (a client's jitter brings one back a little late);
    ``fresh_recently``: a fresh request (not a retry) arrived within the last service time.
    """

    promised: int
    due_soon: int
    fresh_recently: bool


@dataclass
class Dispatch:
    """Tickets that left the queues in one step: now holding a slot, or dropped as expired."""

    admitted: list[Ticket] = field(default_factory=list)
    expired: list[Ticket] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.admitted or self.expired)


class AdmissionView(Protocol):
    """Read-only state offered to gates and schedulers."""

    @property
    def classes(self) -> tuple[str, ...]: ...

    @property
    def limit(self) -> int: ...

    def now(self) -> float: ...

    def in_flight(self, cls: str | None = None) -> int: ...

    def queued(self, cls: str | None = None) -> int: ...

    def policy(self, cls: str) -> ClassPolicy: ...

    def outlook(self, cls: str) -> ClassOutlook: ...

    def next_run(self, cls: str) -> float | None: ...


class AdmissionGate(Protocol):
    """A pre-admission check; return a refusal to turn the request away before it queues."""

    def check(self, request: AdmissionRequest, view: AdmissionView) -> GateRefusal | None: ...


class ClassScheduler(Protocol):
    """Chooses whose queue head takes the next free slot.

    ``waiting`` lists the classes with queued requests in the order their queue heads are
    due: highest priority first, unless a request was placed behind a lower class's queued
    request to keep that one's promise (module docstring). Return one of them, or None to
    keep the slot free (e.g. reserved for another class).
    """

    def pick(self, waiting: Sequence[str], view: AdmissionView) -> str | None: ...


@runtime_checkable
class MinimumShares(Protocol):
    """A scheduler that guarantees a class some slots whatever higher classes want."""

    def minimum_slots(self, cls: str, limit: int) -> int: ...


@runtime_checkable
class ReservedShares(Protocol):
    """A scheduler that keeps some slots of a class from the classes below it."""

    def reserved_slots(self, cls: str, limit: int) -> int: ...


class StrictPriority:
    """Serve the highest-priority class with a queue. Starvation control comes later, as another scheduler."""

    def pick(self, waiting: Sequence[str], view: AdmissionView) -> str | None:
        return waiting[0] if waiting else None


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
        self._max_total = max_queue_total
        if not 0.0 <= returning_share <= 1.0:
            raise ValueError("returning_share must be between 0 and 1")
        self._returning_share = returning_share
        if not 0.0 <= promise_slack < 1.0:
            raise ValueError("promise_slack must be at least 0 and below 1")
        # Share of a class's max_queue_wait a newcomer must leave a queued request of it when
        # going ahead: the estimate's error (see _place).
        self._promise_slack = promise_slack
        # Off: every request is fresh (one FIFO per class, no places kept).
        self._returning_first = returning_first
        self._limit = limit
        self._estimator = estimator
        self._clock = clock
        self._scheduler: ClassScheduler = scheduler or StrictPriority()
        # Decided once: isinstance() against a runtime-checkable Protocol inspects its members
        # on every call, about 15 us, and _wait_at runs on every refusal.
        self._shares: MinimumShares | None = (
            self._scheduler if isinstance(self._scheduler, MinimumShares) else None
        )
        self._reserves: ReservedShares | None = (
            self._scheduler if isinstance(self._scheduler, ReservedShares) else None
        )
        self._lanes_at: dict[tuple[str, int], tuple[int, int]] = {}  # see _lanes
        self.gates: list[AdmissionGate] = list(gates)
        # One list per class, sorted by Ticket.key; together they are the serve order. Lists,
        # not a heap: queues are short, and a cancel removes from the middle.
        self._queues: dict[str, list[Ticket]] = {name: [] for name in names}
        self._rank = {name: i for i, name in enumerate(names)}
        self._in_flight: dict[str, int] = dict.fromkeys(names, 0)
        # Totals kept beside the per-class figures: both are read several times per request.
        self._in_flight_total = 0
        # When the requests holding a slot were admitted, ascending: when their slots free
        # (DrainEstimator.expected_wait's ``admitted``). Kept sorted as they come and go, so a
        # refusal reads the few it needs instead of walking every request in flight (about
        # 100 us a refusal at 256 in flight).
        self._admitted: list[float] = []
        self._queued_total = 0
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
        return self._in_flight_total if cls is None else self._in_flight[cls]

    def saturated(self) -> bool:
        """Every slot of the current limit is taken."""
        return self._in_flight_total >= self._limit.limit

    def queued(self, cls: str | None = None) -> int:
        if cls is None:
            return self._queued_total
        return len(self._queues[cls])

    def outlook(self, cls: str) -> ClassOutlook:
        """What the shim knows of the requests of ``cls`` to come (see :class:`ClassOutlook`)."""
        estimator = self._estimator
        now = self._clock()
        service = estimator.service_time
        fresh = now - self._last_fresh.get(cls, -math.inf) <= service
        promised = estimator.outstanding(cls)
        if not promised:
            return ClassOutlook(0, 0, fresh)
        return ClassOutlook(promised, estimator.promised_within((cls,), -math.inf, now + service), fresh)

    def next_run(self, cls: str) -> float | None:
        """Seconds the request of ``cls`` that would take the next slot (its queue's head, or the
        newcomer offered a free slot) is expected to hold it: its ``max_tokens`` at the measured
        token rate (:meth:`DrainEstimator.run_time`). None when there is none, it does not say
        how long its answer may be, or no token rate was measured yet."""
        offer = self._offer
        if offer is not None and offer.cls == cls:
            request = offer
        elif self._queues[cls]:
            request = self._queues[cls][0].request
        else:
            return None
        return self._estimator.run_time(request.max_tokens)

    def queued_returning(self, cls: str) -> int:
        """Queued requests of ``cls`` that said they are retries (and count as returning)."""
        return sum(t.returning for t in self._queues[cls])

    def oldest_wait(self, cls: str) -> float:
        """Seconds the longest-waiting request of ``cls``'s queue has waited (0 when empty)."""
        queue = self._queues[cls]
        if not queue:
            return 0.0
        return max(0.0, self._clock() - min(t.arrived for t in queue))

    def serve_order(self) -> list[Ticket]:
        """The queued tickets of every class, in the order strict priority would admit them."""
        return list(heapq.merge(*self._queues.values(), key=_key))

    @property
    def overtaken_total(self) -> int:
        """Queued requests :meth:`recheck` turned away since start (the estimator was wrong)."""
        return self._overtaken_total

    def ahead_of(self, cls: str) -> int:
        """Requests that would be served before a fresh newcomer of ``cls`` (strict-priority view)."""
        return sum(len(self._queues[c]) for c in self._classes[: self._rank[cls] + 1])

    def fresh_room(self, bound: int, classes: Iterable[str]) -> int:
        """Places of a queue bound that fresh arrivals may fill; the rest wait for returning ones.

        Places are kept back only while callers of ``classes`` have been promised a return
        (one per promise, at most ``returning_share`` of the bound), so a queue that told
        nobody to come back is all for fresh arrivals.
        """
        if not self._returning_first:
            return bound
        promised = sum(self._estimator.outstanding(c) for c in classes)
        return bound - min(promised, math.floor(self._returning_share * bound + 1e-9))

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
        for gate in self.gates:
            refusal = gate.check(request, self)
            if refusal is not None:
                return self._from_gate(cls, refusal)
        if request.budget is not None and request.budget <= 0:
            return self._reject(cls, "queue_timeout", "request budget (x-request-timeout-ms) already spent")
        now = self._clock()
        if not request.retry:
            self._last_fresh[cls] = now
        policy = self._policies[cls]
        wait = policy.max_queue_wait
        budget_bound = request.budget is not None and request.budget < wait
        deadline = now + (request.budget if budget_bound and request.budget is not None else wait)
        ticket = Ticket(
            id=next(self._ids), request=request, arrived=now, deadline=deadline, budget_bound=budget_bound
        )
        if request.retry and self._returning_first and request.budget is not None:
            # A caller promised a return is back: its promise no longer holds a slot ahead of
            # anyone (it is queued, admitted or refused and told a new one).
            self._estimator.redeem(cls)
        # The common case, a slot free and nobody queued: no place to find, nobody to overtake.
        if not self._queued_total and self._in_flight_total < self._limit.limit:
            self._offer = request
            try:
                offered = self._scheduler.pick((cls,), self) == cls
            finally:
                self._offer = None
        else:
            offered = False
        if offered:
            if self._short_of(ticket, now) is not None:
                self._expire(ticket)
                assert ticket.rejection is not None
                return ticket.rejection
            ticket.state = TicketState.ADMITTED
            ticket.admitted_at = now
            self._in_flight[cls] += 1
            self._in_flight_total += 1
            bisect.insort(self._admitted, now)
            return ticket
        returning = ticket.returning = self._is_returning(request)
        queue = self._queues[cls]
        has_room = self._has_room(cls, returning)
        if not has_room and self.saturated():
            # Full, and no slot for the pump to give anyone: refused whatever its place would
            # be, so its place (a walk of the queue) is not worked out.
            ticket.state = TicketState.CANCELLED
            return self._reject(
                cls, "queue_full", "server at capacity (queue full)", request.budget, stream=request.stream
            )
        ahead, in_class = self._place(ticket, now)
        # Queued tentatively even when full: the pump admits it at once if a slot is
        # usable (e.g. --max-queue 0 with an idle engine), else it is taken back out.
        bisect.insort(queue, ticket, key=_key)
        self._queued_total += 1
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
            self._unqueue(ticket)
            ticket.state = TicketState.CANCELLED
            return self._reject(
                cls, "queue_full", "server at capacity (queue full)", request.budget, stream=request.stream
            )
        early = self._early_refusal(ticket, ahead, in_class)
        if early is not None:
            self._unqueue(ticket)
            ticket.state = TicketState.CANCELLED
            return early
        return ticket

    def refuse_at_once(self, request: AdmissionRequest) -> Rejection | None:
        """:meth:`submit`'s answer when it can only be a refusal whatever the queue's order: every
        slot taken and no place in the queue for ``request``; None otherwise (nothing done).

        For a caller that decides before it has the whole request (the relay, from the head:
        proxy.py): when this returns None it has changed nothing, and the request is submitted
        later as usual.
        """
        cls = request.cls
        if (
            not self.saturated()
            or cls not in self._policies
            or self._has_room(cls, self._is_returning(request))
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

    def release(self, ticket: Ticket, outcome: Outcome) -> Dispatch:
        """Give back the slot of an ADMITTED ticket; returns who moved up."""
        if ticket.state is not TicketState.ADMITTED:
            raise ValueError(f"ticket {ticket.id} is {ticket.state.value}, not admitted")
        ticket.state = TicketState.RELEASED
        self._in_flight[ticket.cls] -= 1
        self._in_flight_total -= 1
        assert ticket.admitted_at is not None
        # Only the times matter, so any entry equal to this ticket's is the one to drop.
        del self._admitted[bisect.bisect_left(self._admitted, ticket.admitted_at)]
        service_time = self._clock() - ticket.admitted_at
        if outcome is Outcome.COMPLETED:
            self._estimator.observe_completion(ticket.cls, service_time)
            if ticket.request.max_tokens is not None:
                self._estimator.observe_tokens(ticket.request.max_tokens, service_time)
        self._limit.on_complete(
            service_time=service_time,
            in_flight=self.in_flight(),
            overloaded=outcome is Outcome.OVERLOADED,
        )
        dispatch = self._pump()
        if self._queued_total and outcome is Outcome.COMPLETED:
            # The service-time estimate moved: the waits promised to those queued moved with it.
            dispatch.expired += self.recheck().expired
        return dispatch

    def cancel(self, ticket: Ticket) -> Dispatch:
        """The caller went away: leave the queue, or give back the slot (as ABORTED)."""
        if ticket.state is TicketState.QUEUED:
            self._unqueue(ticket)
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
        self._unqueue(ticket)
        self._expire(ticket)
        assert ticket.rejection is not None
        return ticket.rejection

    def upstream_unavailable(self, cls: str, detail: str) -> Rejection:
        """The refusal for a request whose upstream could not be reached (always 503)."""
        return Rejection(
            code="upstream_unavailable",
            message=f"upstream unavailable ({detail})",
            retry_after=self._estimator.config.retry_after_min,
            queue_depth=self.queued(cls),
            status=503,
        )

    def overloaded_upstream(self, cls: str, detail: str) -> Rejection:
        """The refusal for a request the engine itself turned away as overloaded (vLLM's 503)."""
        return self._reject(cls, "queue_full", f"upstream engine at capacity ({detail})")

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
        if not self._queued_total or self._estimator.samples == 0:
            return dispatch
        now = self._clock()
        ahead = 0
        seen = dict.fromkeys(self._classes, 0)
        wait = self._walk_waits(soonest=True)
        for ticket in self.serve_order():
            why = self._late(ticket, ahead, seen[ticket.cls], now, wait)
            if why is None:
                ahead += 1
                seen[ticket.cls] += 1
                continue
            self._unqueue(ticket)
            ticket.state = TicketState.EXPIRED
            left = None
            if ticket.request.budget is not None:
                left = ticket.arrived + ticket.request.budget - now
            ticket.rejection = self._reject(
                ticket.cls, "queue_timeout", why, left, stream=ticket.request.stream
            )
            dispatch.expired.append(ticket)
        self._overtaken_total += len(dispatch.expired)
        return dispatch

    # -- internals -------------------------------------------------------------------------
    def _place(self, ticket: Ticket, now: float) -> tuple[int, int]:
        """Give a newcomer its sort key; return how many queued requests (and of its class) are ahead.

        Its natural place: by class, returning before fresh, then arrival. If that is ahead
        of queued requests that one more request ahead would make late (the estimate, as in
        :meth:`recheck`, with ``promise_slack`` of their class's ``max_queue_wait`` kept in
        hand for the estimate's error), it goes right after the last of them instead: its key
        extends that request's key. One walk of the serve order; no walk when it would overtake nobody.
        """
        cls = ticket.cls
        key: tuple[int, ...] = (self._rank[cls], 0 if ticket.returning else 1, ticket.id)
        ticket.key = key
        if not any(q and q[-1].key > key for q in self._queues.values()):
            return self._queued_total, len(self._queues[cls])
        if self._estimator.samples == 0:
            # Estimates on the prior alone refuse nobody (module docstring), so they move nobody.
            order = self.serve_order()
            before = [t for t in order if t.key < key]
            return len(before), sum(t.cls == cls for t in before)
        order = self.serve_order()
        seen = dict.fromkeys(self._classes, 0)
        last_tight: Ticket | None = None
        wait = self._walk_waits()
        for ahead, queued in enumerate(order):
            # Would one more request ahead of it (and of its class, if the same) make it late,
            # or leave it less slack than the estimate's error? Without that slack, newcomers
            # use up a queued request's margin one by one, and a drain slightly slower than
            # estimated then makes it late: refused after seconds of waiting (measured).
            slack = self._promise_slack * self._policies[queued.cls].max_queue_wait
            if (
                queued.key > key
                and self._late(queued, ahead + 1, seen[queued.cls] + (queued.cls == cls), now + slack, wait)
                is not None
            ):
                last_tight = queued
            seen[queued.cls] += 1
        if last_tight is not None:
            key = ticket.key = (*last_tight.key, ticket.id)
        before = [t for t in order if t.key < key]
        return len(before), sum(t.cls == cls for t in before)

    def _early_refusal(self, ticket: Ticket, ahead: int, in_class: int) -> Rejection | None:
        """Refuse a just-queued ticket, ``ahead`` places from the front (``in_class`` of its
        class), that the estimates say cannot be served in time."""
        if self._estimator.samples == 0:
            return None  # the wait estimate would rest on the prior alone
        cls, budget = ticket.cls, ticket.request.budget
        higher = self._classes[: self._rank[cls]]
        # Returns promised before it would be served go ahead of a returning caller of a lower
        # class: each takes a slot first. A fresh arrival yields to the promises of its own
        # class and those above it: a promise is a slot kept for the caller on the one engine
        # (the estimator's single timeline), but a lower class's promise does not hold a slot
        # against a higher class. A batch caller, patient by its budget, is told again when
        # its slot was taken; an interactive caller refused for it fails (measured:
        # docs/benchmarks.md, 'fresh arrivals yield only to their class's promises').
        promised_by = higher if ticket.returning else self._classes[: self._rank[cls] + 1]
        expected = self._wait_at(cls, ahead, in_class, promised_by)
        if budget is not None:
            need = self._estimator.expected_service(ticket.request.stream)
            if expected + need > budget:
                return self._reject(
                    cls,
                    "queue_timeout",
                    f"estimated queue wait {expected:.2f} s + {self._need_name(ticket)} {need:.2f} s "
                    f"exceeds the request budget {budget:.2f} s",
                    budget,
                    stream=ticket.request.stream,
                )
        max_wait = self._policies[cls].max_queue_wait
        if expected > max_wait:
            return self._reject(
                cls,
                "queue_full",
                f"server at capacity (estimated queue wait {expected:.2f} s exceeds the "
                f"{max_wait:g} s limit)",
                budget,
                stream=ticket.request.stream,
            )
        return None

    def _unqueue(self, ticket: Ticket) -> None:
        self._queues[ticket.cls].remove(ticket)
        self._queued_total -= 1

    def _is_returning(self, request: AdmissionRequest) -> bool:
        # Only a caller that says how long it will wait: the shim can then check that it can
        # still be served in time. A retry without a budget is served late and cut by its
        # own timeout as often as not (measured: docs/benchmarks.md, docs/demo.md).
        return self._returning_first and request.returning and request.budget is not None

    def _has_room(self, cls: str, returning: bool) -> bool:
        """Whether the queue has a place for a newcomer of ``cls`` (fresh ones may not take
        the places kept for returning callers, :meth:`fresh_room`)."""
        total = self._max_total
        if returning:
            return len(self._queues[cls]) < self._policies[cls].max_queue and (
                total is None or self._queued_total < total
            )
        return len(self._queues[cls]) < self.fresh_room(self._policies[cls].max_queue, (cls,)) and (
            total is None or self._queued_total < self.fresh_room(total, self._classes)
        )

    def _wait_at(
        self,
        cls: str,
        ahead: int,
        in_class: int,
        promised_by: Sequence[str],
    ) -> float:
        """Expected wait of a request of ``cls`` with ``ahead`` served before it under strict
        priority, ``in_class`` of them of its own class: at the drain rate, bounded by the
        class's guaranteed minimum share, which serves its class in FIFO order whatever
        higher classes want.

        The drain rate counts the slots this class can have (:meth:`_lanes`): not a lower
        class's guaranteed share, which is taken whenever that class has work queued, whatever
        waits above it (always left out, not only while that class has queued requests: a
        lower-class arrival would otherwise make queued requests late that were promised the
        whole engine), nor the slots reserved for higher classes.
        """
        est = self._estimator
        slots, share = self._lanes(cls, self.limit)
        wait = est.expected_wait(ahead, slots, 0, promised_by=promised_by, admitted=self._admitted)
        if share > 0:
            wait = min(wait, est.expected_wait(in_class, share, 0))
        return wait

    def _walk_waits(self, *, soonest: bool = False) -> Callable[[str, int, int], float]:
        """``wait(cls, ahead, in_class)``: :meth:`_wait_at` without promises, for one walk of
        the queue (:meth:`_place`, :meth:`recheck`). Each class's slot times are built once
        per walk, not once per queued request: a walk asks for every queued request, on every
        newcomer placed ahead of others and every recheck (about 170 us a refusal under 2x
        overload, most of it here; docs/benchmarks.md, 'the overload scenarios in virtual time').

        ``soonest``: as if a slot freed now (the wait of those ahead only). The estimate has
        no memory of how long the requests in flight have run, so for a request that has
        already waited it overstates the wait; the recheck judges on this bound instead.
        """
        est, limit, free = self._estimator, self.limit, 1 if soonest else 0
        tables: dict[str, tuple[Callable[[int], float], Callable[[int], float] | None]] = {}

        def wait(cls: str, ahead: int, in_class: int) -> float:
            table = tables.get(cls)
            if table is None:
                slots, share = self._lanes(cls, limit)
                by_share = est.slot_times(share) if share > 0 else None
                table = tables[cls] = (est.slot_times(slots, self._admitted), by_share)
            at, by_share = table
            needed = ahead + 1 - free
            if needed <= 0:
                return 0.0
            seconds = at(needed)
            if by_share is not None:
                mine = in_class + 1 - free
                seconds = min(seconds, by_share(mine) if mine > 0 else 0.0)
            return seconds

        return wait

    def _lanes(self, cls: str, limit: int) -> tuple[int, int]:
        """(the slots a wait of ``cls`` drains on, ``cls``'s guaranteed minimum share) at ``limit``.

        A lower class's guaranteed share is taken whenever that class has work queued, so it
        is left out; so are the slots reserved for higher classes (``cls`` may not use them
        unless they are lent, which the estimate does not count on). Fixed for a limit, and
        asked for on every wait estimate (a newcomer's place and the recheck walk the queue),
        so computed once per limit.
        """
        lanes = self._lanes_at.get((cls, limit))
        if lanes is not None:
            return lanes
        slots, share, rank = limit, 0, self._rank[cls]
        shares = self._shares
        if shares is not None:
            held = sum(shares.minimum_slots(c, limit) for c in self._classes[rank + 1 :])
            slots = max(1, limit - held)
            share = shares.minimum_slots(cls, limit) if rank else 0
        reserves = self._reserves
        if reserves is not None and rank:
            kept = sum(reserves.reserved_slots(c, limit) for c in self._classes[:rank])
            slots = max(1, min(slots, limit - kept))
        if len(self._lanes_at) > 4096:  # an adaptive limit that wandered far: start over
            self._lanes_at.clear()
        lanes = self._lanes_at[(cls, limit)] = (slots, share)
        return lanes

    def _late(
        self, ticket: Ticket, ahead: int, in_class: int, now: float, wait: Callable[[str, int, int], float]
    ) -> str | None:
        """Why a queued ticket with ``ahead`` requests before it (``in_class`` of its class)
        cannot be served in time, or None (``wait``: the walk's :meth:`_walk_waits`).

        Judged on the requests queued ahead of it only, not on promised returns: those may
        not come back (a client gives up, or has no retries left), and a request dropped
        from the queue on a guess cannot be given its place back.
        """
        expected = wait(ticket.cls, ahead, in_class)
        budget = ticket.request.budget
        if budget is not None:
            need = self._estimator.expected_service(ticket.request.stream)
            left = ticket.arrived + budget - now
            if expected + need > left:
                return (
                    f"overtaken in the queue: estimated wait {expected:.2f} s + "
                    f"{self._need_name(ticket)} {need:.2f} s exceeds the remaining request budget "
                    f"{max(0.0, left):.2f} s"
                )
        if now + expected > ticket.deadline and not ticket.budget_bound:
            max_wait = self._policies[ticket.cls].max_queue_wait
            return (
                f"overtaken in the queue: estimated wait {expected:.2f} s more would pass the "
                f"{max_wait:g} s limit"
            )
        return None

    def _short_of(self, ticket: Ticket, now: float) -> float | None:
        """The expected service the ticket's remaining budget cannot cover, else None."""
        budget = ticket.request.budget
        if budget is None:
            return None
        need = self._estimator.expected_service(ticket.request.stream)
        return need if need > 0 and ticket.arrived + budget - now < need else None

    def _need_name(self, ticket: Ticket) -> str:
        if ticket.request.stream and self._estimator.config.stream_served_at == "first_token":
            return "expected time to first token"
        return "expected service time"

    def _pump(self) -> Dispatch:
        dispatch = Dispatch()
        now = self._clock()
        queues = self._queues
        while self._queued_total and self._in_flight_total < self._limit.limit:
            # In the order their heads are due (see ClassScheduler).
            waiting = sorted((c for c in self._classes if queues[c]), key=lambda c: queues[c][0].key)
            cls = self._scheduler.pick(waiting, self)
            if cls is None:
                break
            ticket = queues[cls].pop(0)
            self._queued_total -= 1
            if ticket.deadline <= now or self._short_of(ticket, now) is not None:
                # Its wait or the caller's budget ran out, or what is left of the budget cannot
                # cover the service: never send it to the engine.
                self._expire(ticket)
                dispatch.expired.append(ticket)
                continue
            ticket.state = TicketState.ADMITTED
            ticket.admitted_at = now
            self._in_flight[cls] += 1
            self._in_flight_total += 1
            bisect.insort(self._admitted, now)
            dispatch.admitted.append(ticket)
        return dispatch

    def _expire(self, ticket: Ticket) -> None:
        ticket.state = TicketState.EXPIRED
        now = self._clock()
        need = self._short_of(ticket, now) if ticket.deadline > now else None
        if need is not None:
            assert ticket.request.budget is not None
            left = max(0.0, ticket.arrived + ticket.request.budget - now)
            why = (
                f"remaining request budget {left:.2f} s cannot cover the "
                f"{self._need_name(ticket)} {need:.2f} s"
            )
        elif ticket.budget_bound:
            why = "request budget (x-request-timeout-ms) ran out while queued"
        else:
            why = f"waited the maximum {self._policies[ticket.cls].max_queue_wait:g} s in the queue"
        budget = ticket.request.budget
        remaining = None if budget is None else ticket.arrived + budget - now
        ticket.rejection = self._reject(
            ticket.cls, "queue_timeout", why, remaining, stream=ticket.request.stream
        )

    def _reject(
        self,
        cls: str,
        code: RejectCode,
        why: str,
        budget_left: float | None = None,
        *,
        stream: bool = False,
    ) -> Rejection:
        """A refusal with a spread hint; ``budget_left``: the caller's remaining budget, if known.

        The hint is aimed (:meth:`DrainEstimator.aim`): a client that adds jitter above it
        comes back at its slot on average.

        A retry at the hint (plus the client's jitter above it,
        :meth:`DrainEstimator.latest_return`) that would have less budget left than the time
        it needs once admitted cannot be served: the shim would refuse it on arrival. Such a
        caller is told so instead, with a hint at least its remaining budget (a client that
        honours its deadline, as ``llm_backoff`` does, then gives up now with a typed error
        rather than spend an attempt), and the hint is not remembered as a promise (see
        :meth:`DrainEstimator.retry_after`).
        """
        # A retry would come back returning, behind what is queued now in its class and above.
        higher = self._classes[: self._rank[cls]]
        ahead, in_class = self.ahead_of(cls), len(self._queues[cls])
        wait = self._wait_at(cls, ahead, in_class, higher)
        est = self._estimator
        usable = reach = None
        if budget_left is not None:
            usable = budget_left - est.expected_service(stream)
            # Whether its slot is within reach rests on the prior too: a slot promised on the
            # prior alone would otherwise run up to the end of the budget at a cold start.
            reach = budget_left - (est.expected_service(stream) or est.service_time)
        # A lower-class caller that sent a budget reaching past the longest queue wait of the
        # classes above it is promised no slot before then: those slots are left to
        # higher-class callers (refused now or arriving meanwhile), whose budgets are usually
        # the shorter; the timeline fills gaps, so they can still be promised them.
        horizon = 0.0
        if usable is not None and higher:
            horizon = max(self._policies[c].max_queue_wait for c in higher)
            if est.latest_return(est.aim(horizon)) > usable:
                horizon = 0.0
        # Only a caller that says how long it will wait is served as returning when it comes
        # back (_is_returning); a slot kept for any other would be kept for nobody.
        hint = est.retry_after(
            cls,
            ahead,
            self.limit,
            keep_within=usable,
            wait=wait,
            aimed=True,
            reserve=budget_left is not None,
            reach=reach,
            not_before=horizon,
        )
        # (1e-9: a hint brought forward to return by ``reach`` exactly, less rounding.)
        if reach is not None and budget_left is not None and est.latest_return(hint) > reach + 1e-9:
            hint = min(est.config.retry_after_max, max(hint, budget_left))
        return Rejection(code=code, message=why, retry_after=hint, queue_depth=self.queued(cls))

    def _from_gate(self, cls: str, refusal: GateRefusal) -> Rejection:
        hint = refusal.retry_after
        if hint is None:
            hint = self._estimator.retry_after(cls, self.ahead_of(cls), self.limit)
        return Rejection(
            code=refusal.code,
            message=refusal.message,
            retry_after=hint,
            queue_depth=self.queued(cls),
            type=refusal.type,
            status=refusal.status,
        )


def _key(ticket: Ticket) -> tuple[int, ...]:
    return ticket.key
