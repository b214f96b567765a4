"""The requests holding a slot: how many per class and in all, when each was admitted, how many
were admitted ahead of a higher class's waiting requests (a minimum share serving its class,
:class:`~llm_backoff_shim.decide.waits.QueueWaits` reads it), and the cost they hold together
(KV-cache tokens, :mod:`llm_backoff_shim.decide.cost`; 0 without a cost budget). Every way a
ticket ends goes through :meth:`HeldSlots.give_back`, so the cost comes back with the slot.

When they were admitted says when their slots free (each is expected to end its class's
service time later: :meth:`~llm_backoff_shim.decide.drain_estimate.DrainEstimator.expected_wait`'s
``admitted``), so the times are kept sorted as requests come and go, and a wait estimate reads
the few it needs instead of walking every request in flight (about 100 us a refusal at 256 in
flight).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from llm_backoff_shim.decide.tickets import Ticket, TicketState


class HeldSlots:
    """Slots taken by admitted tickets (module docstring)."""

    __slots__ = ("admitted", "ahead_of_higher", "per_class", "tokens", "tokens_per_class", "total")

    def __init__(self, classes: Sequence[str]) -> None:
        self.per_class: dict[str, int] = dict.fromkeys(classes, 0)
        # Kept beside the per-class figures: both are read several times per request.
        self.total = 0
        #: Admission times of the tickets holding a slot, ascending, per class.
        self.admitted: dict[str, list[float]] = {c: [] for c in classes}
        #: Cost of the requests holding a slot, in KV-cache tokens, in all and per class.
        self.tokens = 0
        self.tokens_per_class: dict[str, int] = dict.fromkeys(classes, 0)
        #: Per class, the tickets holding a slot that were admitted while a higher class had
        #: requests queued.
        self.ahead_of_higher: dict[str, int] = dict.fromkeys(classes, 0)

    def take(self, ticket: Ticket, now: float, *, ahead_of_higher: bool = False) -> None:
        """Admit ``ticket`` at ``now``: it holds a slot until :meth:`give_back`.
        ``ahead_of_higher``: a higher class had requests queued (it was served by its share)."""
        ticket.state = TicketState.ADMITTED
        ticket.admitted_at = now
        ticket.ahead_of_higher = ahead_of_higher
        self.ahead_of_higher[ticket.cls] += ahead_of_higher
        self.per_class[ticket.cls] += 1
        self.total += 1
        self.tokens += ticket.request.cost
        self.tokens_per_class[ticket.cls] += ticket.request.cost
        bisect.insort(self.admitted[ticket.cls], now)

    def give_back(self, ticket: Ticket) -> None:
        """``ticket`` (admitted) no longer holds its slot; the caller sets its new state."""
        self.per_class[ticket.cls] -= 1
        self.ahead_of_higher[ticket.cls] -= ticket.ahead_of_higher
        self.total -= 1
        self.tokens -= ticket.request.cost
        self.tokens_per_class[ticket.cls] -= ticket.request.cost
        assert ticket.admitted_at is not None
        # Only the times matter, so any entry equal to this ticket's is the one to drop.
        times = self.admitted[ticket.cls]
        del times[bisect.bisect_left(times, ticket.admitted_at)]

    def tokens_of(self, classes: Sequence[str]) -> int:
        """Cost held by the requests of ``classes``."""
        per_class = self.tokens_per_class
        return sum(per_class[c] for c in classes)
