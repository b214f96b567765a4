"""Where a newcomer stands in the serve order, and whether queued requests can still be served in time.

A queued request keeps its promise. A request is queued only if its estimated wait at its
place is within its class's ``max_queue_wait`` and its budget (less the service it needs);
that is its promise, and a later arrival must not break it. A newcomer whose natural place is
ahead of queued requests (a higher class, or a returning caller ahead of fresh ones) therefore
checks, in one walk of the queue, which of them one more request ahead would make late by the
estimator, or leave with less than ``promise_slack`` of their class's ``max_queue_wait`` in hand
for the estimate's error, and is placed right after the last such request instead (its key
extends that request's key), where it pushes back only requests with room to spare. If its
wait at that place is past its own limit or budget, it is refused at arrival. The trade-off:
while lower-class or fresh requests near their limit are queued, a higher-class or returning
newcomer waits behind them, and is refused at arrival when that wait is too long for it. The
schedulers see the classes with queued requests in the order their heads are due, so a request
placed behind a lower class's request waits for it.

Invariant: first come, first served within a tenant of a class (returning callers before fresh
ones where the class serves them first), whatever placement does across classes. A newcomer whose
natural place is ahead of a request of its own class that precedes it naturally (its round, then
returning before fresh, then arrival) but was placed behind a lower class's request goes right
after that request instead (:meth:`Placement.place`).

A tenant's turn is not a promise to another tenant's later rounds: a newcomer of a quiet tenant
takes its round's place ahead of a flooding tenant's later rounds whatever that does to their
waits (fair turns, :mod:`llm_backoff_shim.decide.queues`); those made late are turned away by
the recheck with a Retry-After. Protecting them would put every quiet tenant's request behind
the flood, which is what fair turns are for.

A newcomer never waits behind a promise longer than its own: a request of a lower class whose
``max_queue_wait`` is longer than the newcomer's class's (a class held for its callers'
patience, as ``calibrate`` recommends for batch) is passed whatever that does to its wait, and
one made late is turned away by the recheck with a Retry-After; that class's promise holds only
while the classes above leave it the slots. Protecting it too queued interactive callers behind
a queue of batch work held for up to 15 s and refused them at arrival: on the real vLLM,
interactive calls within budget fell from 176 to 123 and useful tokens from 23.6k to 18.0k for
plain openai through the shim. Classes that
share one wait (the shim's defaults, the demo) keep each other's promises as before.

Refused at arrival, once a completion was measured (never on the cold-start prior):

- a caller whose remaining budget cannot cover the expected queue wait plus the time it needs
  once admitted gets ``queue_timeout``;
- a request whose estimated wait (the queued work served before it, higher-priority classes
  included) exceeds its class's ``max_queue_wait`` gets ``queue_full`` at once, instead of
  holding a queue place for the whole wait to be told ``queue_timeout``. ``queue_full``, not
  ``queue_timeout``: the queue is full measured in time, and the caller's own budget played no
  part.

A fresh arrival's expected wait counts the callers of its own class and the classes above it
already promised a return before it would be served: a promise is a slot kept for that caller
(the estimator paces the promises of all classes on one timeline at the drain rate), so a fresh
arrival is queued only into the slots nobody of its class or above was promised; a lower class's
promise yields to it (that caller is told again on its return).

The recheck (:meth:`Placement.overtaken`) is the safety net for estimator error (service times
vary; the estimate moves): it re-estimates every queued request from its place and names those
that can no longer be served within their ``max_queue_wait`` or budget, so they are turned away
now rather than left to wait it out. A class's guaranteed minimum share bounds its wait, so
requests the share will serve in time stay.
"""

from __future__ import annotations

from collections.abc import Iterator

from llm_backoff_shim.decide.drain_estimate import DrainEstimator
from llm_backoff_shim.decide.queues import ClassQueues, natural_key
from llm_backoff_shim.decide.tickets import RejectCode, Ticket
from llm_backoff_shim.decide.waits import QueueWaits, WaitFn, need_name, service_needed


class Placement:
    """Places newcomers so that no queued request is made late, and finds the ones that are."""

    def __init__(
        self, queues: ClassQueues, waits: QueueWaits, estimator: DrainEstimator, *, promise_slack: float
    ) -> None:
        self._policies = queues.policies
        self._queues = queues
        self._waits = waits
        self._estimator = estimator
        # Share of a class's max_queue_wait a newcomer must leave a queued request of it when
        # going ahead: the estimate's error (see place).
        self._promise_slack = promise_slack

    def place(self, ticket: Ticket, now: float) -> tuple[int, int]:
        """Give a newcomer its sort key; return how many queued requests (and of its class) are
        ahead, in queue places (:attr:`Ticket.places`: one each without a cost budget).

        Its natural place (:func:`~llm_backoff_shim.decide.queues.natural_key`): by class, its
        tenant's round (:meth:`ClassQueues.round_for`), returning before fresh, then arrival.
        If that is ahead
        of queued requests that one more request ahead would make late (the estimate, as in
        :meth:`overtaken`, with ``promise_slack`` of their class's ``max_queue_wait`` kept in
        hand for the estimate's error), it goes right after the last of them instead: its key
        extends that request's key. Requests of a lower class with a longer ``max_queue_wait``
        than its own are passed whatever it does to them (module docstring). One walk of the
        serve order; no walk when it would overtake nobody.
        """
        cls, queues = ticket.cls, self._queues
        ticket.round = queues.round_for(cls, ticket.request.tenant, ticket.returning)
        key: tuple[int, ...] = natural_key(queues.rank(cls), ticket)
        ticket.key = key
        if not queues.overtakes_anyone(key):
            # last in line: behind its class too
            return sum(queues.places.values()), queues.places[cls]
        if self._estimator.samples == 0:
            # Estimates on the prior alone refuse nobody (module docstring), so they move nobody.
            order = queues.serve_order()
            key = ticket.key = self._behind_own_class(ticket, key)
            return _places_before(order, key, cls)
        order = queues.serve_order()
        seen = dict.fromkeys(queues.classes, 0)
        last_tight: Ticket | None = None
        wait = self._waits.walk()
        own_wait = self._policies[cls].max_queue_wait
        ahead, mine = 0, ticket.places
        for queued in order:
            # One more request ahead of a queued one: the newcomer's places, of its class or not.
            mine_in_class = mine if queued.cls == cls else 0
            # Would one more request ahead of it (and of its class, if the same) make it late,
            # or leave it less slack than the estimate's error? Without that slack, newcomers
            # use up a queued request's margin one by one, and a drain slightly slower than
            # estimated then makes it late: refused after seconds of waiting (measured).
            queued_wait = self._policies[queued.cls].max_queue_wait
            slack = self._promise_slack * queued_wait
            if (
                queued.key > key
                # a promise longer than the newcomer's own yields to it (module docstring)
                and (queued.cls == cls or queued_wait <= own_wait)
                # so does another tenant's later round: the newcomer's turn (module docstring)
                and not _later_turn(queued, ticket)
                and self.late(queued, ahead + mine, seen[queued.cls] + mine_in_class, now + slack, wait)
                is not None
            ):
                last_tight = queued
            seen[queued.cls] += queued.places
            ahead += queued.places
        if last_tight is not None:
            key = ticket.key = (*last_tight.key, ticket.id)
        key = ticket.key = self._behind_own_class(ticket, key)
        return _places_before(order, key, cls)

    def _behind_own_class(self, ticket: Ticket, key: tuple[int, ...]) -> tuple[int, ...]:
        """``key``, or a key right after the last queued request of the newcomer's class that
        comes before it in its natural order (:func:`natural_key`: round, returning before fresh,
        then arrival).

        The invariant: first come, first served within a tenant of a class (and within
        returning or fresh callers of it), whatever placement does across classes. A request of
        the class placed earlier may stand behind a lower class's request (its key extends that
        request's key); a later one of the same class whose natural key sorts after it and whose
        key sorts ahead of that place must not pass it, so it goes right after it. That only
        moves the newcomer back: it overtakes fewer queued requests than the walk checked, so no
        promise is broken.
        """
        rank = self._queues.rank(ticket.cls)
        mine = natural_key(rank, ticket)
        latest: tuple[int, ...] | None = None
        for queued in self._queues.lists[ticket.cls]:
            precedes = natural_key(rank, queued) < mine
            if precedes and queued.key > key and (latest is None or queued.key > latest):
                latest = queued.key
        return key if latest is None else (*latest, ticket.id)

    def arrival_refusal(self, ticket: Ticket, ahead: int, in_class: int) -> tuple[RejectCode, str] | None:
        """Why a just-queued ticket, ``ahead`` queue places from the front (``in_class`` of its class),
        cannot be served in time by the estimates (a code and a reason), or None."""
        if self._estimator.samples == 0:
            return None  # the wait estimate would rest on the prior alone
        cls, budget = ticket.cls, ticket.request.budget
        # Returns promised before it would be served go ahead of a returning caller of a lower
        # class: each takes a slot first. A fresh arrival yields to the promises of its own
        # class and those above it: a promise is a slot kept for the caller on the one engine
        # (the estimator's single timeline), but a lower class's promise does not hold a slot
        # against a higher class. A batch caller, patient by its budget, is told again when
        # its slot was taken; an interactive caller refused for it fails (measured on a real
        # vLLM: interactive calls within budget fell when batch promises held slots).
        above = self._queues.above(cls)
        # Its own class's promised callers come back into their tenants' turns: behind a
        # newcomer that took its turn ahead of other tenants (they would not be counted twice).
        took_turn = any(_later_turn(queued, ticket) for queued in self._queues.lists[cls])
        promised_by = above if ticket.returning or took_turn else (*above, cls)
        expected = self._waits.at(cls, ahead, in_class, promised_by, ticket.places)
        if budget is not None:
            need = service_needed(self._estimator, ticket.request)
            if expected + need > budget:
                return (
                    "queue_timeout",
                    f"estimated queue wait {expected:.2f} s + {need_name(self._estimator, ticket)} "
                    f"{need:.2f} s exceeds the request budget {budget:.2f} s",
                )
        max_wait = self._policies[cls].max_queue_wait
        if expected > max_wait:
            return (
                "queue_full",
                f"server at capacity (estimated queue wait {expected:.2f} s exceeds the "
                f"{max_wait:g} s limit)",
            )
        return None

    def overtaken(self, now: float) -> Iterator[tuple[Ticket, str]]:
        """The queued tickets that, from their current place, cannot be served in time, each with
        the reason, in serve order; never on the cold-start prior.

        Lazy: the caller takes each one out of the queue (and refuses it) before asking for the
        next, so each refusal's Retry-After is estimated on the queue as it is at that moment.
        """
        if not self._queues.total or self._estimator.samples == 0:
            return
        ahead = 0
        seen = dict.fromkeys(self._queues.classes, 0)
        wait = self._waits.walk(soonest=True)
        for ticket in self._queues.serve_order():
            why = self.late(ticket, ahead, seen[ticket.cls], now, wait)
            if why is None:
                ahead += ticket.places
                seen[ticket.cls] += ticket.places
                continue
            yield ticket, why

    def late(self, ticket: Ticket, ahead: int, in_class: int, now: float, wait: WaitFn) -> str | None:
        """Why a queued ticket with ``ahead`` queue places before it (``in_class`` of its class)
        cannot be served in time, or None (``wait``: the walk's :meth:`QueueWaits.walk`).

        Judged on the requests queued ahead of it only, not on promised returns: those may
        not come back (a client gives up, or has no retries left), and a request dropped
        from the queue on a guess cannot be given its place back.
        """
        expected = wait(ticket.cls, ahead, in_class, ticket.places)
        budget = ticket.request.budget
        if budget is not None:
            need = service_needed(self._estimator, ticket.request)
            left = ticket.arrived + budget - now
            if expected + need > left:
                return (
                    f"overtaken in the queue: estimated wait {expected:.2f} s + "
                    f"{need_name(self._estimator, ticket)} {need:.2f} s exceeds the remaining request "
                    f"budget {max(0.0, left):.2f} s"
                )
        if now + expected > ticket.deadline and not ticket.budget_bound:
            max_wait = self._policies[ticket.cls].max_queue_wait
            return (
                f"overtaken in the queue: estimated wait {expected:.2f} s more would pass the "
                f"{max_wait:g} s limit"
            )
        return None


def _later_turn(queued: Ticket, newcomer: Ticket) -> bool:
    """Whether ``queued`` is another tenant's request of the newcomer's class in a later round
    (it yields its place to the newcomer's turn: module docstring)."""
    return (
        queued.cls == newcomer.cls
        and queued.request.tenant != newcomer.request.tenant
        and queued.round > newcomer.round
    )


def _places_before(order: list[Ticket], key: tuple[int, ...], cls: str) -> tuple[int, int]:
    """Queue places before ``key`` in ``order``: in all, and of ``cls``."""
    ahead = in_class = 0
    for queued in order:
        if queued.key < key:
            ahead += queued.places
            in_class += queued.places if queued.cls == cls else 0
    return ahead, in_class
