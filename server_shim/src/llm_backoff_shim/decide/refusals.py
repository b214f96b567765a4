"""Refusals with a Retry-After each: aimed at a slot, spread over a burst, kept within the caller's budget.

Every refusal the controller hands out is built here. Its hint comes from
:meth:`~llm_backoff_shim.decide.drain_estimate.DrainEstimator.retry_after`: the first free
place on the estimator's one timeline at or after the wait a retry would have (behind what is
queued now in its class and above), aimed so that a client adding jitter above it comes back
at its slot on average, and remembered as a promise the queues keep places for
(:mod:`llm_backoff_shim.decide.queues`) when the caller said how long it will wait.

A caller whose retry at the hint could no longer be served (less budget left when it comes
back than the time it needs once admitted) is told so instead, with a hint at least its
remaining budget: a client that honours its deadline (``llm_backoff`` does) then gives up now
with a typed error rather than spend an attempt, and the hint is not remembered as a promise.
"""

from __future__ import annotations

from dataclasses import replace

from llm_backoff_shim.decide.drain_estimate import DrainEstimator
from llm_backoff_shim.decide.limit import ConcurrencyLimit
from llm_backoff_shim.decide.queues import ClassQueues
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import RejectCode, Rejection, Ticket
from llm_backoff_shim.decide.waits import QueueWaits, need_name, service_needed, short_of


class Refusals:
    """Builds every refusal of the controller, each with its Retry-After (module docstring)."""

    def __init__(
        self, queues: ClassQueues, waits: QueueWaits, estimator: DrainEstimator, limit: ConcurrencyLimit
    ) -> None:
        self._policies = queues.policies
        self._queues = queues
        self._waits = waits
        self._estimator = estimator
        self._limit = limit

    def reject(
        self,
        cls: str,
        code: RejectCode,
        why: str,
        budget_left: float | None = None,
        request: AdmissionRequest | None = None,
    ) -> Rejection:
        """A refusal with a spread hint; ``budget_left``: the caller's remaining budget, if known;
        ``request``: what it asked for (whether it needs the whole answer within that budget).

        The hint is aimed (:meth:`DrainEstimator.aim`): a client that adds jitter above it
        comes back at its slot on average. A retry at the hint (plus the client's jitter above
        it, :meth:`DrainEstimator.latest_return`) that would have less budget left than the
        time it needs once admitted cannot be served: such a caller is told a hint at least
        its remaining budget, not remembered as a promise (module docstring).
        """
        # A retry would come back returning, behind what is queued now in its class and above.
        higher = self._queues.above(cls)
        ahead, in_class = self._queues.ahead_of(cls), len(self._queues.lists[cls])
        wait = self._waits.at(cls, ahead, in_class, higher)
        est = self._estimator
        usable = reach = None
        if budget_left is not None:
            need = est.expected_service(False) if request is None else service_needed(est, request)
            usable = budget_left - need
            # Whether its slot is within reach rests on the prior too: a slot promised on the
            # prior alone would otherwise run up to the end of the budget at a cold start.
            reach = budget_left - (need or est.service_time)
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
        # back (ClassQueues.is_returning); a slot kept for any other would be kept for nobody.
        hint = est.retry_after(
            cls,
            ahead,
            self._limit.limit,
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
