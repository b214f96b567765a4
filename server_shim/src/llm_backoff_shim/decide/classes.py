"""Traffic classes sharing the in-flight slots: reservations, minimum shares, holds.

:class:`SharedSlots` is the :class:`~llm_backoff_shim.decide.scheduler.ClassScheduler` the
shim runs with. Classes are listed highest priority first (``interactive``, ``batch``).
When a slot frees and several classes have queued requests:

1. **Minimum share first, once due.** A class holding fewer slots than its minimum share
   (``ceil(min_share * limit)``) takes the slot even if a higher class is waiting, once its
   queue's head is due: at its latest start by the estimate, its deadline (the class's
   ``max_queue_wait`` or the caller's remaining budget, whichever ends first) less a service
   time per queue place it stands for and one more for the estimate's error, and never
   before it has spent ``due_after`` (default half) of its wait; at ``due_after`` while
   nothing was measured (:meth:`~llm_backoff_shim.decide.admission.AdmissionController.share_due_in`).
   So batch work is never starved, however long an interactive flood lasts, and a peak of
   interactive traffic that ends before a batch request must start passes it, as an
   earliest-deadline scheduler would let it. The share counts requests, not their cost: a
   long prompt admitted during a chat peak costs the engine several chats' work (its prefill
   stalls every decode step, its KV cache slows each one), so the share waits for the latest
   start rather than taking its slot at once (measured in virtual time on the scoreboard's
   mix, ``bench/bench_admission_model.py``; figures in docs/benchmarks.md).
2. **Then priority.** The highest-priority waiting class that *may* take the slot
   gets it; within a class the queue is first come, first served (the controller's
   FIFO).
3. **Reservations.** A class may take a slot only if the slots still free afterwards
   cover the unused reservations of every higher class. With ``interactive`` reserving
   ``ceil(0.25 * limit)`` slots, a batch flood fills at most the other 75 % and an
   interactive request arriving mid-flood finds a free slot at once. Reservations
   never cover every slot: each class can always use at least one when the others
   are idle, so a misconfigured reservation cannot starve a class forever.
   A reservation is kept for a class's arrivals nobody can foresee. While the class is
   itself being turned away and no fresh request of it has arrived for a service time,
   its next requests are its callers coming back, and the shim told them when: so
   while none of those is due within one service time, its unused reserved slots are
   lent to lower classes (when one falls due, it waits for the next slot to free,
   about one service time / limit). Without lending, in a burst of 200 the engine left
   2 of 8 slots idle for 2.4 s while only batch callers were due (in the virtual-time model).
   Work conservation wins over the reservation in one more case: while the class has
   nobody queued and nobody promised a return, its unused reserved slots are lent to a
   lower-class request that gives the slot back within the class's longest queue wait
   (its TTFT budget: the controller folds ``--ttft-slo`` into it): one whose expected answer
   (its class's recent answers as the cost budget prices them, capped by its ``max_tokens``)
   at the measured token rate (:meth:`~llm_backoff_shim.decide.view.AdmissionView.next_run`)
   ends within it. A request of the class arriving meanwhile waits for that slot at most its
   budget. Before any answer was learned, a request is judged by its ``max_tokens``, and one
   that names none is not lent a slot this way.
4. **Holds.** A predicate (``hold(cls)``) may keep a class from taking new slots at
   all: engine saturation holds every class, a YELLOW/RED interactive SLO holds batch.
   A held class still gets its minimum share unless the hold is for every class
   (``hold(None)``, the engine is saturated: nothing new goes upstream).

Pure: it reads the controller's view (limit, in-flight counts) and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from llm_backoff_shim.decide.view import AdmissionView

#: ``hold(None)``: hold every class; ``hold(cls)``: hold ``cls`` beyond its minimum share.
HoldPredicate = Callable[[str | None], bool]


def share_slots(share: float, limit: int) -> int:
    """Slots a fractional share of ``limit`` stands for: rounded up, so any share > 0 is >= 1 slot."""
    if share <= 0:
        return 0
    return min(limit, math.ceil(share * limit - 1e-9))


@dataclass(frozen=True)
class ClassShares:
    """Fractions of the concurrency limit: ``reserved`` for a class, ``minimum`` guaranteed to it."""

    reserved: Mapping[str, float] = field(default_factory=dict)
    minimum: Mapping[str, float] = field(default_factory=dict)
    #: Share of its queue wait a class's head spends at least before its minimum share is due
    #: (0: at once); the share is due later, at the head's latest start, once measured.
    due_after: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.due_after <= 1.0:
            raise ValueError(f"due_after must be between 0 and 1, got {self.due_after}")
        for kind, shares in (("reserved", self.reserved), ("minimum", self.minimum)):
            for cls, share in shares.items():
                if not (0.0 <= share <= 1.0) or math.isnan(share):
                    raise ValueError(f"{kind} share of class {cls!r} must be between 0 and 1, got {share}")
        if sum(self.reserved.values()) > 1.0 + 1e-9:
            raise ValueError("reserved shares add up to more than 1")


class SharedSlots:
    """Reserved shares, minimum shares and holds over strict priority (module docstring)."""

    def __init__(self, shares: ClassShares, *, hold: HoldPredicate | None = None) -> None:
        self._shares = shares
        self._holds: list[HoldPredicate] = [hold] if hold is not None else []

    def add_hold(self, hold: HoldPredicate) -> None:
        self._holds.append(hold)

    def held(self, cls: str | None) -> bool:
        return any(h(cls) for h in self._holds)

    def reserved_slots(self, cls: str, limit: int) -> int:
        return share_slots(self._shares.reserved.get(cls, 0.0), limit)

    def minimum_slots(self, cls: str, limit: int) -> int:
        return share_slots(self._shares.minimum.get(cls, 0.0), limit)

    @property
    def due_after(self) -> float:
        return self._shares.due_after

    def usable_slots(self, cls: str, view: AdmissionView) -> int:
        """Slots ``cls`` could fill if every class above it stayed below its reservation."""
        higher = view.classes[: view.classes.index(cls)]
        return max(0, view.limit - sum(self.reserved_slots(h, view.limit) for h in higher))

    def pick(self, waiting: Sequence[str], view: AdmissionView) -> str | None:
        # pick runs on every admission, the fast path too: no generator when nothing holds.
        if not waiting or (self._holds and self.held(None)):
            return None
        limit = view.limit
        free = limit - view.in_flight()
        if free <= 0:
            return None
        for cls in waiting:
            if view.in_flight(cls) < self.minimum_slots(cls, limit) and view.share_due_in(cls) <= 0:
                return cls
        for cls in waiting:
            if self._holds and self.held(cls):
                continue
            if free - 1 >= self._unused_reservations_above(cls, view):
                return cls
        return None

    def _unused_reservations_above(self, cls: str, view: AdmissionView) -> int:
        if cls == view.classes[0]:
            return 0  # nothing above the highest class (the common request's class)
        unused = reserved = 0
        for higher in view.classes:
            if higher == cls:
                break
            slots = self.reserved_slots(higher, view.limit)
            reserved += slots
            idle = slots - view.in_flight(higher)
            if idle > 0 and not self._lent(higher, view, cls):
                unused += idle
        # Reservations never take a lower class's last slot: an idle engine always serves it.
        # (A lent reservation still counts here: it is lent, not given up.)
        excess = reserved - (view.limit - 1)
        return max(0, unused - max(0, excess))

    @staticmethod
    def _lent(cls: str, view: AdmissionView, borrower: str) -> bool:
        """``cls``'s unused reservation is lent to ``borrower``'s next request: all ``cls``
        expects are returns, none due soon; or it expects nothing it was told of and that
        request gives the slot back within ``cls``'s longest queue wait (module docstring)."""
        outlook = view.outlook(cls)
        if outlook.promised == 0:
            if view.queued(cls):
                return False
            run = view.next_run(borrower)
            return run is not None and run <= view.policy(cls).max_queue_wait
        return not outlook.due_soon and not outlook.fresh_recently
