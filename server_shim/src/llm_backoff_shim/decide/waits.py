"""How long a queued request is expected to wait from its place, and what it needs once admitted.

A wait is counted on the slots the request's class can have, at the drain rate of
:class:`~llm_backoff_shim.decide.drain_estimate.DrainEstimator`, and bounded by the class's
guaranteed minimum share (:class:`~llm_backoff_shim.decide.scheduler.MinimumShares`), which
serves its class in FIFO order whatever higher classes want once the class's queue head has
reached its latest start (never before ``due_after`` of its wait): the bound counts from then
(``share_due_in``).
Left out of those slots: a lower class's guaranteed share once it may come due (its
``share_due_in``: for an empty queue, as for an arrival now), whatever waits above it; a wait
that ends before then drains on every slot. Left out for good, the share made every chat's
estimate on an 8-slot engine count 7 slots while the batch share stayed idle through a chat
peak (its queue head's latest start not reached), and chats were refused at arrival on waits
their queue never reached (served chats' first tokens came by 4.1 s at most against a 5 s
budget). A wait that reaches the share's due time counts the share out for all of it (a
bound, not an interpolation). Also left out: the slots reserved for higher classes
(:class:`~llm_backoff_shim.decide.scheduler.ReservedShares`: a class may not use them unless
they are lent, which the estimate does not count on).

With a cost budget (:mod:`llm_backoff_shim.decide.token_budget`), ``ahead`` and ``in_class``
count queue places, not requests: a queued request that costs ``k`` slots' share of the budget
stands for ``k`` places (:attr:`~llm_backoff_shim.decide.tickets.Ticket.places`), and a request
waits for as many slots to free as it stands for. The requests in flight still free one slot
each at their expected end: the estimate keeps when each was admitted, not what each costs.

What a request needs once admitted (:func:`service_needed`): the whole service, or the first token of
a stream if so configured or if its budget is for the answer to begin. A caller whose remaining budget
cannot cover its wait plus that need would only make the engine do work its own deadline cuts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from llm_backoff_shim.decide.drain_estimate import Admitted, DrainEstimator
from llm_backoff_shim.decide.limit import ConcurrencyLimit
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.scheduler import ClassScheduler, MinimumShares, ReservedShares
from llm_backoff_shim.decide.tickets import Ticket

#: ``wait(cls, ahead, in_class, places)``: seconds until a request of ``cls`` standing for
#: ``places`` queue places, with ``ahead`` places served before it, ``in_class`` of them of its
#: own class, gets a slot.
WaitFn = Callable[[str, int, int, int], float]
#: ``at(n)``: seconds until the n-th slot frees (:meth:`DrainEstimator.slot_times`).
SlotTimes = Callable[[int], float]


class QueueWaits:
    """Wait estimates for the controller's classes (module docstring).

    ``admitted``: when the requests holding a slot were admitted, ascending, per class; the
    controller keeps those lists up to date in place, and each estimate reads the few it needs.
    """

    def __init__(
        self,
        classes: Sequence[str],
        scheduler: ClassScheduler,
        estimator: DrainEstimator,
        limit: ConcurrencyLimit,
        admitted: Admitted,
        share_due_in: Callable[[str], float] | None = None,
        served_by_share: Mapping[str, int] | None = None,
    ) -> None:
        self._classes = tuple(classes)
        self._rank = {name: i for i, name in enumerate(self._classes)}
        self._estimator = estimator
        self._limit = limit
        self._admitted = admitted
        # Decided once: isinstance() against a runtime-checkable Protocol inspects its members
        # on every call, about 15 us, and a wait is estimated on every refusal.
        self._shares: MinimumShares | None = scheduler if isinstance(scheduler, MinimumShares) else None
        self._reserves: ReservedShares | None = scheduler if isinstance(scheduler, ReservedShares) else None
        self._lanes_at: dict[tuple[str, int], tuple[int, int]] = {}  # see lanes
        self._whole_at: dict[tuple[str, int], int] = {}  # see whole_lanes
        # Seconds before a class's minimum share is due to serve its queue (0: at once).
        self._share_due_in = share_due_in
        # Per class, the requests in flight admitted ahead of a higher class's queue (by its share).
        self._served_by_share: Mapping[str, int] = served_by_share or {}

    def at(self, cls: str, ahead: int, in_class: int, promised_by: Sequence[str], places: int = 1) -> float:
        """Expected wait of a request of ``cls`` with ``ahead`` places served before it under
        strict priority, ``in_class`` of them of its own class, and the promised returns of
        ``promised_by`` due before then served first too (:meth:`DrainEstimator.expected_wait`);
        ``places``: the places it stands for itself (module docstring)."""
        est, limit = self._estimator, self._limit.limit
        slots, share = self.lanes(cls, limit)
        extra = places - 1
        turns = self._turns(cls)

        def on(lanes: int) -> float:
            return est.expected_wait(
                ahead + extra, lanes, 0, promised_by=promised_by, admitted=self._admitted, turn_class=turns
            )

        whole = self.whole_lanes(cls, limit)
        wait = on(whole)
        if whole > slots and wait > self._lower_share_due(cls):
            wait = on(slots)
        if share > 0:
            wait = min(wait, self._share_delay(cls) + est.expected_wait(in_class + extra, share, 0))
        return wait

    def _turns(self, cls: str) -> str | None:
        """Whose service time a freed slot turns over at for a request of ``cls``: those served
        before it are all of its class when it is the highest (strict priority), else a mix."""
        return cls if self._rank[cls] == 0 else None

    def _share_delay(self, cls: str) -> float:
        due_in = self._share_due_in
        return 0.0 if due_in is None else due_in(cls)

    def walk(self, *, soonest: bool = False) -> WaitFn:
        """:meth:`at` without promises, for one walk of the queue (placing a newcomer ahead of
        others, the recheck). Each class's slot times are built once per walk, not once per
        queued request: a walk asks for every queued request, on every newcomer placed ahead of
        others and every recheck (about 170 us a refusal under 2x overload, most of it here).

        ``soonest``: as if a slot freed now (the wait of those ahead only). The estimate has
        no memory of how long the requests in flight have run, so for a request that has
        already waited it overstates the wait; the recheck judges on this bound instead.
        """
        est, limit, free = self._estimator, self._limit.limit, 1 if soonest else 0
        tables: dict[str, tuple[SlotTimes, SlotTimes | None, float, SlotTimes | None, float]] = {}

        def wait(cls: str, ahead: int, in_class: int, places: int) -> float:
            table = tables.get(cls)
            if table is None:
                slots, share = self.lanes(cls, limit)
                by_share = est.slot_times(share) if share > 0 else None
                delay = self._share_delay(cls) if share > 0 else 0.0
                turns = self._turns(cls)
                at = est.slot_times(slots, self._admitted, turns)
                whole = self.whole_lanes(cls, limit)
                at_whole = est.slot_times(whole, self._admitted, turns) if whole > slots else None
                due = self._lower_share_due(cls) if at_whole is not None else math.inf
                table = tables[cls] = (at, by_share, delay, at_whole, due)
            at, by_share, delay, at_whole, due = table
            needed = ahead + places - free
            if needed <= 0:
                return 0.0
            seconds = at(needed) if at_whole is None else at_whole(needed)
            if seconds > due:
                seconds = at(needed)
            if by_share is not None:
                mine = in_class + places - free
                seconds = min(seconds, delay + (by_share(mine) if mine > 0 else 0.0))
            return seconds

        return wait

    def whole_lanes(self, cls: str, limit: int) -> int:
        """The slots a wait of ``cls`` drains on while no lower class's minimum share is due:
        :meth:`lanes` with those shares counted in (the reserved slots of higher classes stay out)."""
        self.lanes(cls, limit)
        return self._whole_at[(cls, limit)]

    def _lower_share_due(self, cls: str) -> float:
        """Seconds before the soonest minimum share of a class below ``cls`` may come due (0:
        at once, not known, or that class's share is serving it now; inf: there is none).

        A class holding slots it was given ahead of a higher class's queue is served by its
        share now: under sustained overload its queue heads come due one after another, and
        the share's slot turns over to the next one as each ends (the due time of its current
        head alone said the slot was free, and chats queued on it were refused after their
        wait). Its requests admitted while nobody above waited are not: their slots go to the
        higher class as they end, until its own head comes due. Counted out for those too, a
        chat burst on the real vLLM (8 slots, batch in flight from before it) was estimated on
        7 lanes while every freed slot went to chat: the first chat refused at arrival was
        estimated at 5.5 s, and the one queued before it was served at 3.9 s."""
        due_in = self._share_due_in
        if due_in is None:
            return 0.0
        rank, limit, shares, serving = self._rank[cls], self._limit.limit, self._shares, self._served_by_share
        assert shares is not None
        lower = [c for c in self._classes[rank + 1 :] if shares.minimum_slots(c, limit) > 0]
        if any(serving.get(c) for c in lower):
            return 0.0
        return min((due_in(c) for c in lower), default=math.inf)

    def lanes(self, cls: str, limit: int) -> tuple[int, int]:
        """(the slots a wait of ``cls`` drains on, ``cls``'s guaranteed minimum share) at ``limit``
        (module docstring). Fixed for a limit, and asked for on every wait estimate (a
        newcomer's place and the recheck walk the queue), so computed once per limit.
        """
        lanes = self._lanes_at.get((cls, limit))
        if lanes is not None:
            return lanes
        slots, whole, share, rank = limit, limit, 0, self._rank[cls]
        shares = self._shares
        if shares is not None:
            held = sum(shares.minimum_slots(c, limit) for c in self._classes[rank + 1 :])
            slots = max(1, limit - held)
            share = shares.minimum_slots(cls, limit) if rank else 0
        reserves = self._reserves
        if reserves is not None and rank:
            kept = sum(reserves.reserved_slots(c, limit) for c in self._classes[:rank])
            slots = max(1, min(slots, limit - kept))
            whole = max(1, limit - kept)
        if len(self._lanes_at) > 4096:  # an adaptive limit that wandered far: start over
            self._lanes_at.clear()
            self._whole_at.clear()
        self._whole_at[(cls, limit)] = max(slots, whole)
        lanes = self._lanes_at[(cls, limit)] = (slots, share)
        return lanes


def short_of(estimator: DrainEstimator, ticket: Ticket, now: float) -> float | None:
    """The expected service the ticket's remaining budget cannot cover, else None."""
    budget = ticket.request.budget
    if budget is None:
        return None
    needed = service_needed(estimator, ticket.request)
    return needed if needed > 0 and ticket.arrived + budget - now < needed else None


def service_needed(estimator: DrainEstimator, request: AdmissionRequest) -> float:
    """Seconds ``request`` needs once admitted before its budget is met (module docstring)."""
    return estimator.expected_service(request.stream, request.budget_to_start, request.cls)


def need_name(estimator: DrainEstimator, ticket: Ticket) -> str:
    """How a refusal message names what the ticket needs once admitted."""
    request = ticket.request
    if estimator.served_at_first_byte(request.stream, request.budget_to_start):
        return "expected time to first token"
    return "expected service time"
