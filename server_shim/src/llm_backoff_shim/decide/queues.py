"""The bounded per-class queues, their one serve order, and the places kept for returning callers.

One FIFO queue per traffic class, classes listed highest priority first (``interactive`` before
``batch``); each class's ``max_queue`` bounds its queue and ``max_queue_total`` all queues
together. A class without a ``max_queue`` holds what the engine drains within its
``max_queue_wait`` at the pace measured: every slot turning over at the service time's EWMA,
the class's own for the highest class (its queue is served before anyone else's, so the slots
turn over at its pace, as :class:`~llm_backoff_shim.decide.waits.QueueWaits` counts its wait).
Counted at every class's mean, a chat burst on the real vLLM with batch in flight was held to
20 places while the 20th chat was served 2.9 s into its 5 s budget. The bound follows the
engine's speed as it is now, where a count measured once (calibrate's requests/s at its knee
times the wait) moved by 40 % between runs on one engine within ten minutes and goes stale when
the engine slows. Nobody queued is evicted when it shrinks. Until one request has ended the
bound is one turn of the slots, not the prior's: places promised on a guess became refusals
after a wait once the first measurement came in (a burst of 200 at the start, in the
virtual-time model: 80 % served within the deadline against 96 %).

All queued requests stand in one serve order, each with a sort key
(:attr:`~llm_backoff_shim.decide.tickets.Ticket.key`): by class (highest first), then the
tenant's turn (its round), returning before fresh within a round, then arrival;
:mod:`llm_backoff_shim.decide.placement` may extend a newcomer's key to put it behind a request
whose promise it would break.

Fair turns between tenants within a class (start-time fair queuing, as round robin between
flows): a tenant's n-th waiting request of a class stands in the class's round n, counted from
the round the class is serving, so while several tenants wait they are served one request each
in turn; the tenant is the request's API key (its hash) or its ``--tenant-header`` value, every
anonymous caller one tenant. Within a tenant: returning before fresh, then arrival. A returning
request takes its tenant's next turn and moves the tenant's fresh ones back a round each
(:meth:`ClassQueues.take_turn`): its callers' retries go ahead of its own fresh calls, never
ahead of another tenant's turn. A tenant alone has rounds that rise along that order, so its
serve order is the one-FIFO-per-class order above. A full class queue does not lock the others
out: a newcomer whose tenant holds fewer than its fair share of the class's places (the bound
over the tenants waiting, its own counted) takes the place of the last in line of the tenant
holding the most (:meth:`ClassQueues.displaced_by`), which is refused ``queue_full`` with a
Retry-After, as it would have been had it come after. Places, not a cap per tenant: a tenant
alone, or beside quiet ones, still fills the queue the engine drains.

Returning callers first. A request whose client says it is a retry (``x-stainless-retry-count``
>= 1) and says how long it will wait (``x-request-timeout-ms``) was most likely told a
Retry-After and honoured it; Retry-After is an estimate, not a reservation, so without help it
would find its place taken by fresh arrivals and be turned away again. So, within its class, a
returning request is served before the fresh ones (where that breaks no promise), and while
callers have been promised a return, up to ``returning_share`` of each queue bound (one place
per promise) is kept for returning requests: a full queue refuses a fresh arrival before it
refuses a returning one. A request already queued is never evicted. ``returning_first=False``
turns the order and the kept places off (every request is fresh; promised returns still count
in a fresh arrival's wait): with short deadlines and clients that send no budget, retries
served first can be served too late (docs/demo.md).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Mapping

from llm_backoff_shim.decide.drain_estimate import DrainEstimator
from llm_backoff_shim.decide.limit import ConcurrencyLimit
from llm_backoff_shim.decide.requests import AdmissionRequest, ClassPolicy
from llm_backoff_shim.decide.tickets import Ticket


def _key(ticket: Ticket) -> tuple[int, ...]:
    return ticket.key


def natural_key(rank: int, ticket: Ticket) -> tuple[int, int, int, int]:
    """``ticket``'s natural place in the serve order, its class's ``rank`` given: its class, its
    round, returning before fresh, then arrival."""
    return (rank, ticket.round, 0 if ticket.returning else 1, ticket.id)


class ClassQueues:
    """Queued tickets, one list per class sorted by key, and the bounds on them (module docstring).

    ``lists[cls]`` is read by the controller on its hot paths; change them only through
    :meth:`insert`, :meth:`remove` and :meth:`pop_head`, which keep :attr:`total`.
    """

    def __init__(
        self,
        policies: Mapping[str, ClassPolicy],
        estimator: DrainEstimator,
        limit: ConcurrencyLimit,
        *,
        max_total: int | None,
        returning_share: float,
        returning_first: bool,
    ) -> None:
        self._policies = policies
        self._classes = tuple(policies)
        self._rank = {name: i for i, name in enumerate(self._classes)}
        self._estimator = estimator
        self._limit = limit
        self._max_total = max_total
        self._returning_share = returning_share
        # Off: every request is fresh (one FIFO per class, no places kept).
        self._returning_first = returning_first
        # Lists, not a heap: queues are short, and a cancel removes from the middle.
        self.lists: dict[str, list[Ticket]] = {name: [] for name in self._classes}
        # Kept beside the per-class lists: read several times per request.
        self.total = 0
        #: Queue places per class, each ticket counted as its ``places`` (1 without a cost budget).
        self.places: dict[str, int] = dict.fromkeys(self._classes, 0)
        # The round each class is serving: the highest of the tickets that left its head.
        self._round: dict[str, int] = dict.fromkeys(self._classes, 0)

    @property
    def policies(self) -> Mapping[str, ClassPolicy]:
        """Each class's policy, highest priority first."""
        return self._policies

    @property
    def classes(self) -> tuple[str, ...]:
        return self._classes

    def above(self, cls: str) -> tuple[str, ...]:
        """The classes of higher priority than ``cls``, highest first."""
        return self._classes[: self._rank[cls]]

    def rank(self, cls: str) -> int:
        """``cls``'s place in the priority order (0: the highest)."""
        return self._rank[cls]

    # -- the serve order ---------------------------------------------------------------------
    def insert(self, ticket: Ticket) -> None:
        bisect.insort(self.lists[ticket.cls], ticket, key=_key)
        self.total += 1
        self.places[ticket.cls] += ticket.places

    def remove(self, ticket: Ticket) -> None:
        self.lists[ticket.cls].remove(ticket)
        self.total -= 1
        self.places[ticket.cls] -= ticket.places

    def pop_head(self, cls: str) -> Ticket:
        self.total -= 1
        ticket = self.lists[cls].pop(0)
        self.places[cls] -= ticket.places
        self._round[cls] = max(self._round[cls], ticket.round)
        return ticket

    def round_for(self, cls: str, tenant: str | None, returning: bool) -> int:
        """The round a newcomer of ``tenant`` waits in within ``cls``: one after its tenant's
        latest queued request there, never before the round the class is serving; a returning
        one, the round of its tenant's first fresh request in its natural place, if any
        (:meth:`take_turn` then moves those back)."""
        current = self._round[cls]
        queue = self.lists[cls]
        mine = [t for t in queue if t.request.tenant == tenant]
        if returning:
            if len(mine) == len(queue):
                # Alone in the class: ahead of its fresh ones wherever placement put them, as in
                # one queue per class (a round of its fresh ones would put it behind those placed
                # behind another request).
                return current
            fresh = [t.round for t in mine if not t.returning and self._natural(t)]
            if fresh:
                return min(fresh)
        return max(current, max(t.round for t in mine) + 1) if mine else current

    def take_turn(self, ticket: Ticket) -> None:
        """A queued returning ``ticket`` took its tenant's next turn: the tenant's fresh requests
        of its class in their natural places behind it move back a round each, and the requests
        placed right behind one of them (their keys extend its key) move with it."""
        queue, tenant = self.lists[ticket.cls], ticket.request.tenant
        if all(queued.request.tenant == tenant for queued in queue):
            return  # alone in the class: it already stands ahead of its fresh ones (round_for)
        renamed: dict[tuple[int, ...], tuple[int, ...]] = {}
        for queued in queue:
            mine = queued.request.tenant == tenant and not queued.returning
            if mine and self._natural(queued) and queued.key > ticket.key:
                old = queued.key
                queued.round += 1
                queued.key = natural_key(old[0], queued)
                renamed[old] = queued.key
        if not renamed:
            return
        for tickets in self.lists.values():
            for queued in tickets:
                root = queued.key[:4]
                if len(queued.key) > 4 and root in renamed:
                    queued.key = renamed[root] + queued.key[4:]
            tickets.sort(key=_key)

    @staticmethod
    def _natural(ticket: Ticket) -> bool:
        """Whether ``ticket`` stands in its natural place (placement extended no key of it)."""
        return len(ticket.key) == 4

    def displaced_by(self, request: AdmissionRequest) -> Ticket | None:
        """The queued ticket a newcomer takes the place of when its class's queue is full: the
        last in line of the tenant holding the most places, when the newcomer's tenant holds fewer
        than its fair share (the class's bound over the tenants waiting, its own counted) and
        that tenant more; None otherwise (module docstring)."""
        cls, tenant = request.cls, request.tenant
        held: dict[str | None, int] = {tenant: 0}
        for queued in self.lists[cls]:
            held[queued.request.tenant] = held.get(queued.request.tenant, 0) + queued.places
        share = self.bound(cls) / len(held)
        most = max((t for t in held if t != tenant), key=held.__getitem__, default=None)
        if held[tenant] >= share or most is None or held[most] <= share:
            return None
        return next(t for t in reversed(self.lists[cls]) if t.request.tenant == most)

    def serve_order(self) -> list[Ticket]:
        """The queued tickets of every class, in the order strict priority would admit them."""
        return list(heapq.merge(*self.lists.values(), key=_key))

    def heads_due(self) -> list[str]:
        """The classes with queued requests, in the order their heads are due (ClassScheduler)."""
        lists = self.lists
        return sorted((c for c in self._classes if lists[c]), key=lambda c: lists[c][0].key)

    def overtakes_anyone(self, key: tuple[int, ...]) -> bool:
        """Whether a newcomer with ``key`` would stand ahead of some queued request."""
        return any(q and q[-1].key > key for q in self.lists.values())

    def ahead_of(self, cls: str) -> int:
        """Requests that would be served before a fresh newcomer of ``cls`` (strict-priority view)."""
        lists = self.lists
        return sum(len(lists[c]) for c in self._classes[: self._rank[cls] + 1])

    def places_ahead_of(self, cls: str) -> int:
        """:meth:`ahead_of` in queue places (:attr:`Ticket.places`): what a wait estimate counts."""
        places = self.places
        return sum(places[c] for c in self._classes[: self._rank[cls] + 1])

    def returning(self, cls: str) -> int:
        """Queued requests of ``cls`` that said they are retries (and count as returning)."""
        return sum(t.returning for t in self.lists[cls])

    def oldest_arrival(self, cls: str) -> float | None:
        """When the longest-waiting request of ``cls``'s queue arrived; None when it is empty."""
        queue = self.lists[cls]
        return min(t.arrived for t in queue) if queue else None

    # -- room, and the places kept for returning callers -------------------------------------
    def is_returning(self, request: AdmissionRequest) -> bool:
        """Whether ``request`` queues as returning (ahead of fresh ones, in the kept places).

        Only a caller that says how long it will wait: the shim can then check that it can
        still be served in time. A retry without a budget is served late and cut by its own
        timeout as often as not (measured: docs/benchmarks.md, docs/demo.md).
        """
        return self._returning_first and request.returning and request.budget is not None

    def bound(self, cls: str) -> int:
        """``cls``'s queue bound: its ``max_queue``, else what every slot drains within the
        class's ``max_queue_wait`` at the service time measured (the class's own for the highest
        class), at least 1; as many as the slots before any was measured (module docstring)."""
        policy = self._policies[cls]
        if policy.max_queue is not None:
            return policy.max_queue
        slots = self._limit.limit
        if not self._estimator.samples:
            return slots
        turns = cls if self._rank[cls] == 0 else None
        drained = self._estimator.capacity_rate(slots, turns) * policy.max_queue_wait
        return max(1, math.floor(drained + 1e-9))

    def has_room(self, cls: str, returning: bool) -> bool:
        """Whether the queue has a place for a newcomer of ``cls`` (fresh ones may not take
        the places kept for returning callers, :meth:`fresh_room`)."""
        total, bound = self._max_total, self.bound(cls)
        if returning:
            return len(self.lists[cls]) < bound and (total is None or self.total < total)
        return len(self.lists[cls]) < self.fresh_room(bound, (cls,)) and (
            total is None or self.total < self.fresh_room(total, self._classes)
        )

    def fresh_room(self, bound: int, classes: Iterable[str]) -> int:
        """Places of a queue bound that fresh arrivals may fill; the rest wait for returning ones.

        Places are kept back only while callers of ``classes`` have been promised a return
        (one per promise, at most ``returning_share`` of the bound), so a queue that told
        nobody to come back is all for fresh arrivals.
        """
        if not self._returning_first:
            return bound
        promised = sum(self._estimator.promises.outstanding(c) for c in classes)
        return bound - min(promised, math.floor(self._returning_share * bound + 1e-9))
