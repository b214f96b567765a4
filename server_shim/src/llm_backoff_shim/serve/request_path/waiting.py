"""The asyncio edge of admission: waiting in the queue as an awaitable.

:class:`AsyncAdmission` wraps the pure :class:`AdmissionController`. A queued ticket
gets a future and a loop timer at its deadline; whoever moves the controller
(a release, a cancel, a timer) resolves the futures of the tickets that moved in the
same synchronous step, so the controller's state and the futures never disagree.

After each request queued, :meth:`AdmissionController.recheck` (the safety net for estimator
error; a release runs it too) may turn away queued requests the estimate now says are late;
their futures resolve with the rejection at once.

Cancellation (the client disconnected while queued) is handled in ``acquire``: the
ticket leaves the queue, or, if it was admitted in the instant before the
cancellation arrived, its slot is given back. Nothing the caller does can leak a slot
as long as it calls :meth:`release` for every :class:`Grant` (``async with``
:meth:`slot` does that).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Dispatch, Outcome, Rejection, Ticket, TicketState

Clock = Callable[[], float]


@dataclass(frozen=True)
class Grant:
    """A slot upstream; ``queue_time`` seconds were spent waiting for it."""

    ticket: Ticket
    queue_time: float


class AsyncAdmission:
    def __init__(self, controller: AdmissionController, clock: Clock) -> None:
        self.controller = controller
        self._clock = clock
        self._waiters: dict[int, asyncio.Future[Grant | Rejection]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}

    @property
    def waiting(self) -> int:
        """Futures not yet resolved (equals the controller's queued count when nothing leaks)."""
        return len(self._waiters)

    async def acquire(self, request: AdmissionRequest) -> Grant | Rejection:
        """Wait for a slot; returns a Grant (caller must :meth:`release`) or a Rejection."""
        decision = self.controller.submit(request)
        moved = self.controller.take_moved()
        if moved is not None:
            self._apply(moved)
        if isinstance(decision, Rejection):
            return decision
        if decision.state is TicketState.ADMITTED:
            # A slot the queued could not take (the scheduler held it): nobody was delayed.
            return Grant(decision, 0.0)
        ticket = decision
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Grant | Rejection] = loop.create_future()
        self._waiters[ticket.id] = future
        delay = max(0.0, ticket.deadline - self._clock())
        self._timers[ticket.id] = loop.call_later(delay, self._on_deadline, ticket)
        self._apply(self.controller.recheck())
        try:
            return await future
        except BaseException:
            # Cancelled (client gone) or torn down: give back whatever the ticket holds.
            self._forget(ticket.id)
            self._apply(self.controller.cancel(ticket))
            raise

    def release(self, grant: Grant, outcome: Outcome, answer_tokens: int | None = None) -> None:
        """Give back the grant's slot; ``answer_tokens`` as :meth:`AdmissionController.release`."""
        if grant.ticket.state is TicketState.ADMITTED:
            self._apply(self.controller.release(grant.ticket, outcome, answer_tokens))

    def reschedule(self) -> None:
        """Let queued requests move after an outside change (engine recovered, SLO state, limit)."""
        self._apply(self.controller.reschedule())

    def _on_deadline(self, ticket: Ticket) -> None:
        self._timers.pop(ticket.id, None)
        rejection = self.controller.expire(ticket)
        if rejection is not None:
            self._resolve(ticket.id, rejection)

    def _apply(self, dispatch: Dispatch) -> None:
        for ticket in dispatch.admitted:
            self._resolve(ticket.id, Grant(ticket, ticket.queue_time))
        for ticket in dispatch.expired:
            assert ticket.rejection is not None
            self._resolve(ticket.id, ticket.rejection)

    def _resolve(self, ticket_id: int, result: Grant | Rejection) -> None:
        future = self._forget(ticket_id)
        if future is not None and not future.done():
            future.set_result(result)

    def _forget(self, ticket_id: int) -> asyncio.Future[Grant | Rejection] | None:
        timer = self._timers.pop(ticket_id, None)
        if timer is not None:
            timer.cancel()
        return self._waiters.pop(ticket_id, None)
