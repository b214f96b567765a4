"""What a request brings to the admission decision: its class's policy and the request itself.

A request names its traffic class (``x-request-class``; :class:`ClassPolicy` bounds each
class's queue and queue wait), may say how long its caller will wait (its budget,
``x-request-timeout-ms``), whether it streams, how long its answer may be (``max_tokens``),
whether that budget is for the answer to begin rather than for the whole call
(``x-request-timeout-scope: start``), whether it is a retry
(``x-stainless-retry-count``), and what its tenant's quota said of it
(:class:`QuotaVerdict`, asked at the edge, where the quota store is). A retry that says how
long it will wait is served as *returning*: ahead of the fresh arrivals of its class
(:mod:`llm_backoff_shim.decide.queues`). Anyone can claim to be a retry: the claim buys a
place ahead of fresh arrivals of the same class, nothing more; tenant quotas, budgets and
class bounds apply unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class UnknownClassError(ValueError):
    """``x-request-class`` names a class this shim does not serve."""

    def __init__(self, value: str, known: Sequence[str]) -> None:
        super().__init__(f"unknown request class {value!r}; expected one of: {', '.join(known)}")
        self.value = value
        self.known = tuple(known)


@dataclass(frozen=True)
class ClassPolicy:
    """Queue bound and longest queue wait (seconds) of one traffic class.

    ``max_queue`` None: the bound follows the engine, what it drains within ``max_queue_wait``
    at the pace measured (:meth:`~llm_backoff_shim.decide.queues.ClassQueues.bound`).
    """

    name: str
    max_queue: int | None
    max_queue_wait: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("class name must not be empty")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"class {self.name}: max_queue must be >= 0")
        if not (self.max_queue_wait > 0 and math.isfinite(self.max_queue_wait)):
            raise ValueError(f"class {self.name}: max_queue_wait must be a positive finite number")


@dataclass(frozen=True, slots=True)
class QuotaVerdict:
    """What a tenant's quota said of a request before it may queue: over quota, with
    ``retry_after`` seconds until its buckets hold enough again; or ``store_error`` (the kind
    of failure) when the quota store could not be asked; within quota when both are None.
    The controller's quota gate (:class:`~llm_backoff_shim.decide.tenants.QuotaGate`) decides
    on it."""

    tenant: str
    retry_after: float | None = None
    store_error: str | None = None


@dataclass(frozen=True)
class AdmissionRequest:
    """What the decision may look at: the class, the caller's remaining budget (s), a tenant key,
    whether the body asks for a stream (served at the first token rather than at the end),
    how many times the caller says it has retried this call (``x-stainless-retry-count``), and
    the most output tokens the body asks for (``max_tokens`` / ``max_completion_tokens``; None
    when it does not say), and whether the budget ends when the answer begins (``budget_to_start``:
    a caller with a time-to-first-token budget, whose answer may then stream on), what its
    tenant's quota said of it (``quota``: None when it has no quota), and what it may cost the
    engine (``cost``: KV-cache tokens, its prompt plus its answer's limit,
    :mod:`llm_backoff_shim.decide.cost`; 0 when not priced, as without a cost budget)."""

    cls: str
    budget: float | None = None
    tenant: str | None = None
    stream: bool = False
    retry: int = 0
    max_tokens: int | None = None
    budget_to_start: bool = False
    quota: QuotaVerdict | None = None
    cost: int = 0

    @property
    def returning(self) -> bool:
        """A caller coming back (after a Retry-After, usually): served before fresh arrivals."""
        return self.retry >= 1
