"""A request's place and how it ends: tickets, refusals, outcomes, the dispatch of one step.

A :class:`Ticket` is queued, then admitted (holding a slot), then released; every ticket ends
in exactly one of RELEASED, CANCELLED, EXPIRED, so in-flight and queued counts return to zero
whatever the mix of outcomes. Every refusal the controller hands out, a gate's included, is a
:class:`Rejection` (rendered by :mod:`llm_backoff_shim.serve.api.rejection`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from llm_backoff_shim.decide.requests import AdmissionRequest

RejectCode = Literal["queue_full", "queue_timeout", "slo_shed", "tenant_rate_limited", "upstream_unavailable"]
ErrorType = Literal["server_overloaded", "rate_limit_exceeded"]


@dataclass(frozen=True)
class Rejection:
    """A refusal, ready for :mod:`llm_backoff_shim.serve.api.rejection` to render (docs/protocol.md).

    ``message`` is the reason only; the renderer appends ", retry in N s".
    ``queue_depth``: the refused class's queue as the controller hands the refusal out (it
    sets it on a gate's refusal). ``status`` None means the configured ``--reject-status``.
    """

    code: RejectCode
    message: str
    retry_after: float
    queue_depth: int = 0
    type: ErrorType = "server_overloaded"
    status: int | None = None


class TicketState(enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    RELEASED = "released"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class Outcome(enum.Enum):
    """How an admitted request ended; COMPLETED and ENDED_BY_CLIENT feed the estimates.

    ENDED_BY_CLIENT: the client closed a 2xx stream after its answer began (a client-side
    stop, a caller that read what it wanted): the engine held the slot that long and produced
    that many tokens, which is what the drain rate and the answer lengths measure;
    CLIENT_ERROR: the upstream answered 4xx (quick, says nothing about generation time);
    OVERLOADED: the upstream itself refused as overloaded (a signal for adaptive limits);
    ABORTED: the caller left before its answer began, or the shim cut it.
    """

    COMPLETED = "completed"
    ENDED_BY_CLIENT = "ended_by_client"
    CLIENT_ERROR = "client_error"
    UPSTREAM_ERROR = "upstream_error"
    OVERLOADED = "overloaded"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place: queued, then admitted (holding a slot), then released.

    ``key`` orders the queued tickets of all classes into one serve order
    (:mod:`llm_backoff_shim.decide.queues`); ``round``: its tenant's turn within its class
    (:meth:`ClassQueues.round_for <llm_backoff_shim.decide.queues.ClassQueues.round_for>`);
    ``returning``: queued in its class's returning lane;
    ``places``: the queue places it stands for in a wait estimate (1, or more for a request
    that costs several slots' share of a cost budget: :meth:`TokenBudget.places
    <llm_backoff_shim.decide.token_budget.TokenBudget.places>`);
    ``ahead_of_higher``: admitted while a higher class had requests queued
    (:class:`~llm_backoff_shim.decide.slots.HeldSlots`).
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
    round: int = 0
    returning: bool = False
    places: int = 1
    ahead_of_higher: bool = False

    @property
    def cls(self) -> str:
        return self.request.cls

    @property
    def queue_time(self) -> float:
        """Seconds spent queued (0 when admitted on arrival)."""
        return 0.0 if self.admitted_at is None else self.admitted_at - self.arrived


@dataclass
class Dispatch:
    """Tickets that left the queues in one step: now holding a slot, or dropped as expired."""

    admitted: list[Ticket] = field(default_factory=list)
    expired: list[Ticket] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.admitted or self.expired)
