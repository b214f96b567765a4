"""Every refusal the controller hands out, each with its Retry-After.

Refusals are built here: their code, message and queue depth; their hints come from
:mod:`llm_backoff_shim.decide.retry_after` (:class:`~llm_backoff_shim.decide.retry_after.RefusalHints`),
from the refused caller's place and budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from llm_backoff_shim.decide.drain_estimate import DrainEstimator
from llm_backoff_shim.decide.limit import ConcurrencyLimit
from llm_backoff_shim.decide.queues import ClassQueues
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.retry_after import RefusalHints
from llm_backoff_shim.decide.tickets import RejectCode, Rejection, Ticket
from llm_backoff_shim.decide.waits import QueueWaits, need_name, short_of


class Refusals:
    """Builds every refusal of the controller, each with its Retry-After (module docstring)."""

    def __init__(
        self,
        queues: ClassQueues,
        waits: QueueWaits,
        estimator: DrainEstimator,
        limit: ConcurrencyLimit,
        places_of: Callable[[AdmissionRequest], int] | None = None,
    ) -> None:
        self._policies = queues.policies
        self._queues = queues
        self._estimator = estimator
        self._hints = RefusalHints(queues, waits, estimator, limit, places_of)

    def reject(
        self,
        cls: str,
        code: RejectCode,
        why: str,
        budget_left: float | None = None,
        request: AdmissionRequest | None = None,
    ) -> Rejection:
        """A refusal with a hint from :meth:`RefusalHints.for_caller`; ``budget_left``: the
        caller's remaining budget, if known; ``request``: what it asked for."""
        hint = self._hints.for_caller(cls, budget_left, request)
        return Rejection(code=code, message=why, retry_after=hint, queue_depth=len(self._queues.lists[cls]))

    def expired(self, ticket: Ticket, now: float) -> Rejection:
        """The ``queue_timeout`` for a ticket leaving the queue unserved: its wait or budget ran
        out, or what is left of its budget cannot cover the service it needs."""
        need = short_of(self._estimator, ticket, now) if ticket.deadline > now else None
        if need is not None:
            assert ticket.request.budget is not None
            left = max(0.0, ticket.arrived + ticket.request.budget - now)
            why = (
                f"remaining request budget {left:.2f} s cannot cover the "
                f"{need_name(self._estimator, ticket)} {need:.2f} s"
            )
        elif ticket.budget_bound:
            why = "request budget (x-request-timeout-ms) ran out while queued"
        else:
            why = f"waited the maximum {self._policies[ticket.cls].max_queue_wait:g} s in the queue"
        return self.reject(ticket.cls, "queue_timeout", why, self.budget_left(ticket, now), ticket.request)

    def overtaken(self, ticket: Ticket, why: str, now: float) -> Rejection:
        """The ``queue_timeout`` for a queued ticket the recheck found can no longer be served in time."""
        return self.reject(ticket.cls, "queue_timeout", why, self.budget_left(ticket, now), ticket.request)

    def from_gate(self, cls: str, refusal: Rejection) -> Rejection:
        """A gate's refusal as the controller hands it out: with the class's queue depth."""
        return replace(refusal, queue_depth=len(self._queues.lists[cls]))

    def upstream_unavailable(self, cls: str, detail: str) -> Rejection:
        """The refusal for a request whose upstream could not be reached (always 503)."""
        return Rejection(
            code="upstream_unavailable",
            message=f"upstream unavailable ({detail})",
            retry_after=self._estimator.config.retry_after_min,
            queue_depth=len(self._queues.lists[cls]),
            status=503,
        )

    @staticmethod
    def budget_left(ticket: Ticket, now: float) -> float | None:
        """Seconds left of the caller's budget (may be negative), or None when it sent none."""
        budget = ticket.request.budget
        return None if budget is None else ticket.arrived + budget - now
