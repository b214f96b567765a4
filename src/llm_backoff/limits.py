"""The seam between the retrying transport and anything that limits calls.

The transport knows nothing about buckets or budgets; it only talks to these
protocols. `ratelimit.RateLimiter` and `budget.RetryBudget` implement them, and a
user can pass their own object (a company-wide limiter, say) as long as it fits.

Order of calls for one HTTP attempt, first attempt and retries alike:

1. ``permit = limiter.acquire_for(request, timeout=time_left)`` (or
   ``await limiter.acquire_for_async(...)``) blocks until the call may go out;
   it raises :class:`llm_backoff.errors.RateLimitTimeout` when it cannot be
   granted within ``timeout`` seconds (the caller's deadline).
2. the attempt is sent;
3. ``permit.settle(status=..., body=...)`` exactly once, with the response status
   (``None`` when the attempt raised) and the response body bytes the transport
   saw (the whole body for JSON, the tail of a server-sent-event stream, or
   ``None``), so token estimates can be corrected from ``usage`` and an adaptive
   limiter can react to 429/503.

For retries, before sleeping: ``budget.try_spend()`` returns False when the retry
budget is exhausted, and the failure is then raised at once. Every first attempt
calls ``budget.record_request()``.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

logger = logging.getLogger("llm_backoff")


class RequestInfo(Protocol):
    """What a limiter may look at to price a request (an httpx/httpx2 Request fits)."""

    @property
    def method(self) -> str: ...

    @property
    def content(self) -> bytes: ...


@runtime_checkable
class Permit(Protocol):
    def settle(self, *, status: int | None, body: bytes | None) -> None:
        """Report how the attempt ended; called exactly once per permit."""


@runtime_checkable
class CallLimiter(Protocol):
    def acquire_for(self, request: RequestInfo, *, timeout: float | None) -> Permit: ...

    async def acquire_for_async(self, request: RequestInfo, *, timeout: float | None) -> Permit: ...


@runtime_checkable
class RetryBudgetLike(Protocol):
    def record_request(self) -> None:
        """A first attempt was made: it earns retry credit."""

    def try_spend(self) -> bool:
        """Take credit for one retry; False means: do not retry."""


def settle_quietly(permit: Permit | None, status: int | None, body: bytes | None) -> None:
    """``permit.settle(...)`` when there is a permit; a limiter that raises is logged, not raised.

    A limiter bug must not turn a finished call into a failure.
    """
    if permit is None:
        return
    try:
        permit.settle(status=status, body=body)
    except Exception:
        logger.exception("llm_backoff: permit.settle raised")
