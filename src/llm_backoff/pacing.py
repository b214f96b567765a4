"""Holding sends to the budget the server last stated (`server_budget`), before it must refuse.

Bookkeeping: every send takes a `Ticket` numbered by a running count of sends (and of
estimated LLM tokens, the same estimate `ratelimit.RateLimiter` charges). A response to
ticket ``X`` that says ``remaining = R`` means the server will take sends up to number
``X + R`` in that count, less one for each earlier send still unanswered (the server may not
have counted it yet, so it is assumed not to have). A send may go while its number stays
within that bound for every limit. Until the stated reset only a tighter bound replaces it
(answers overtake each other, so a looser one may be older news); after it, any answer
does. Counting in sends rather than in time keeps it exact under any latency, and
concurrent senders share the remaining budget instead of each believing it has all of it.

At the stated reset the limit is back to ``limit``: the bound grows by ``limit - R``. OpenAI
and Anthropic document token buckets (the reset is when the allowance is full again), so for
their headers it grows steadily until then and sends are paced at ``(limit - R) / reset``
rather than held for the whole reset; the IETF draft's quota windows give it all at once at
the reset. Waiters sleep until the bound allows them and re-check, so only as many go as the
budget allows; the rest wait for the answers. Without a stated limit one request goes at
the reset and the others wait for its answer. With the budget spent, no reset known and
nothing in flight to bring news, the limit is forgotten: unknown means a send is allowed
(the server is the judge, and a 429 is retried as before).

`ServerPacer` is shared by the threads and tasks of one wrapped client (one engine): the
decisions are made under a short lock and the waits happen outside it, with ``time.sleep``
or ``asyncio.sleep``. Until a response carries such headers it only counts sends.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llm_backoff.errors import RateLimitTimeout
from llm_backoff.limits import CallLimiter, Permit, RequestInfo, settle_quietly
from llm_backoff.server_budget import Getter, Kind, Limit, mentions_limits, read_limits
from llm_backoff.tokens import estimate_tokens

Clock = Callable[[], float]

#: How long a waiter sleeps before looking again when only an answer in flight can free budget.
RECHECK = 0.05


@dataclass(slots=True)
class Ticket:
    """One send: its number in the running counts (itself included) and its token estimate."""

    sends: int
    tokens: float
    cost: float
    answered: bool = False


@dataclass(slots=True)
class _Bound:
    """One limit: sends (or tokens) up to ``bound`` in the running count may go now.

    A limit that ``refills`` gains ``limit - remaining`` steadily from ``observed_at`` to
    ``reset_at``; one that does not gains it all at ``reset_at``.
    """

    kind: Kind
    bound: float
    remaining: float
    limit: float | None
    reset_at: float | None
    observed_at: float
    refills: bool

    def _refilling(self) -> tuple[float, float] | None:
        """(what comes back, over how long) while refilling; None otherwise."""
        if not self.refills or self.limit is None or self.reset_at is None:
            return None
        span = self.reset_at - self.observed_at
        gain = self.limit - self.remaining
        return (gain, span) if span > 0 and gain > 0 else None

    def at(self, now: float) -> float:
        refill = self._refilling()
        if refill is None:
            return self.bound
        gain, span = refill
        return self.bound + gain * min(1.0, max(0.0, now - self.observed_at) / span)

    def until(self, after: float, now: float) -> float:
        """Seconds until the bound reaches ``after`` (it reaches the full limit at ``reset_at``)."""
        assert self.reset_at is not None
        refill = self._refilling()
        if refill is None:
            return self.reset_at - now
        gain, span = refill
        need = after - self.bound
        return max(0.0, self.observed_at + min(1.0, need / gain) * span - now)


@dataclass
class PaceState:
    """The pure decisions (no lock, no sleeping): what `ServerPacer` runs under its lock."""

    sends: int = 0
    tokens: float = 0.0
    limits: dict[str, _Bound] = field(default_factory=dict)
    in_flight: dict[int, Ticket] = field(default_factory=dict)

    def needs_tokens(self) -> bool:
        return any(b.kind == "tokens" for b in self.limits.values())

    def _roll(self, now: float) -> None:
        for name, b in list(self.limits.items()):
            if b.reset_at is not None and now >= b.reset_at:
                if b.limit is None and b.kind == "tokens":
                    del self.limits[name]
                elif b.limit is None:  # how much is back is not said: one send asks
                    b.bound = self.sends + 1.0
                    b.reset_at = None
                else:
                    # A send in flight within the old budget may land in the new window:
                    # count it there too (those beyond it are charged there already).
                    if b.kind == "requests":
                        unsure = sum(1.0 for t in self.in_flight.values() if t.sends <= b.bound)
                    else:
                        unsure = sum(t.cost for t in self.in_flight.values() if t.tokens <= b.bound)
                    b.bound += max(0.0, b.limit - b.remaining) - unsure
                    b.remaining = b.limit
                    b.reset_at = None

    def wait(self, cost: float, now: float) -> float:
        """Seconds to wait before a send costing ``cost`` tokens may go (0: now); takes nothing."""
        self._roll(now)
        wait = 0.0
        for name, b in list(self.limits.items()):
            after = self.sends + 1 if b.kind == "requests" else self.tokens + min(cost, b.limit or cost)
            if after <= b.at(now) + 1e-9:
                continue
            if b.reset_at is not None:
                wait = max(wait, b.until(after, now))
            elif self.in_flight:
                wait = max(wait, RECHECK)
            else:  # spent, no reset known and no answer to come: nothing left to go by
                del self.limits[name]
        return wait

    def take(self, cost: float) -> Ticket:
        self.sends += 1
        self.tokens += cost
        ticket = Ticket(self.sends, self.tokens, cost)
        self.in_flight[id(ticket)] = ticket
        return ticket

    def done(self, ticket: Ticket) -> None:
        """The attempt ended without an answer that said anything (or it was given up)."""
        ticket.answered = True
        self.in_flight.pop(id(ticket), None)

    def observe(self, ticket: Ticket, limits: list[Limit], now: float) -> None:
        """Re-base each stated limit on ``ticket``, the send the answer belongs to."""
        self.done(ticket)
        earlier = [t for t in self.in_flight.values() if t.sends < ticket.sends]
        for limit in limits:
            if limit.kind == "requests":
                bound = ticket.sends + limit.remaining - len(earlier)
            else:
                bound = ticket.tokens + limit.remaining - sum(t.cost for t in earlier)
            held = self.limits.get(limit.name)
            if (
                held is not None
                and held.reset_at is not None
                and now < held.reset_at
                and bound >= held.at(now)
            ):
                # Before the reset a looser answer is an older one: the server may have taken
                # an earlier-numbered send after this one (answers overtake each other).
                continue
            reset_at = None if limit.reset is None else now + limit.reset
            self.limits[limit.name] = _Bound(
                limit.kind, bound, limit.remaining, limit.limit, reset_at, now, limit.refills
            )


class ServerPacer:
    """The send budget of one wrapped client, as its server last stated it (module docstring)."""

    def __init__(self, *, clock: Clock = time.monotonic, wall_clock: Clock = time.time) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self.state = PaceState()

    def _estimate(self, request: RequestInfo) -> float:
        if not self.state.limits:
            return 0.0
        if not self.state.needs_tokens():
            return 0.0
        url = getattr(request, "url", None)
        return float(estimate_tokens(request.content, path=str(getattr(url, "path", "") or "")))

    def _try(self, cost: float, deadline: float | None) -> Ticket | float:
        with self._lock:
            now = self._clock()
            wait = self.state.wait(cost, now) if self.state.limits else 0.0
            if wait <= 0:
                return self.state.take(cost)
        left = None if deadline is None else deadline - now
        if left is not None and wait > left:
            if wait > RECHECK or left <= 0:
                raise RateLimitTimeout(
                    f"the server's stated rate limit leaves no room for this call before its deadline "
                    f"(it would go in {wait:.3f} s, {max(left, 0.0):.3f} s left)"
                )
            wait = left
        return wait

    def _deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else self._clock() + max(timeout, 0.0)

    def acquire(self, request: RequestInfo, timeout: float | None) -> Ticket:
        """Block until the server's stated budget allows this send; RateLimitTimeout past ``timeout``."""
        deadline = self._deadline(timeout)
        cost = self._estimate(request)
        while True:
            got = self._try(cost, deadline)
            if isinstance(got, Ticket):
                return got
            time.sleep(got)

    async def acquire_async(self, request: RequestInfo, timeout: float | None) -> Ticket:
        deadline = self._deadline(timeout)
        cost = self._estimate(request)
        while True:
            got = self._try(cost, deadline)
            if isinstance(got, Ticket):
                return got
            await asyncio.sleep(got)

    def observe(self, ticket: Ticket, names: list[str], get: Getter) -> None:
        """Read an answer's headers (lower-case ``names``, ``get`` by name) for ``ticket``'s send."""
        if ticket.answered:
            return
        limits = read_limits(get, self._wall_clock()) if mentions_limits(names) else []
        with self._lock:
            if limits:
                self.state.observe(ticket, limits, self._clock())
            else:
                self.state.done(ticket)

    def done(self, ticket: Ticket) -> None:
        if not ticket.answered:
            with self._lock:
                self.state.done(ticket)


class PacedPermit:
    """A `ServerPacer` ticket and the permit of the caller's own limiter (if any), settled together."""

    __slots__ = ("_pacer", "inner", "ticket")

    def __init__(self, pacer: ServerPacer, ticket: Ticket, inner: Permit | None) -> None:
        self._pacer = pacer
        self.ticket = ticket
        self.inner = inner

    def observe(self, names: list[str], get: Getter) -> None:
        self._pacer.observe(self.ticket, names, get)

    def settle(self, *, status: int | None, body: bytes | None) -> None:
        self._pacer.done(self.ticket)
        settle_quietly(self.inner, status, body)


class PacedLimiter:
    """A `CallLimiter`: the server's stated budget first, then the caller's own limiter (both apply)."""

    def __init__(self, pacer: ServerPacer, inner: CallLimiter | None, clock: Clock) -> None:
        self.pacer = pacer
        self.inner = inner
        self._clock = clock

    def _left(self, timeout: float | None, started: float) -> float | None:
        return None if timeout is None else timeout - (self._clock() - started)

    def acquire_for(self, request: RequestInfo, *, timeout: float | None) -> PacedPermit:
        started = self._clock()
        ticket = self.pacer.acquire(request, timeout)
        inner: Permit | None = None
        if self.inner is not None:
            try:
                inner = self.inner.acquire_for(request, timeout=self._left(timeout, started))
            except BaseException:
                self.pacer.done(ticket)
                raise
        return PacedPermit(self.pacer, ticket, inner)

    async def acquire_for_async(self, request: RequestInfo, *, timeout: float | None) -> PacedPermit:
        started = self._clock()
        ticket = await self.pacer.acquire_async(request, timeout)
        inner: Permit | None = None
        if self.inner is not None:
            try:
                inner = await self.inner.acquire_for_async(request, timeout=self._left(timeout, started))
            except BaseException:
                self.pacer.done(ticket)
                raise
        return PacedPermit(self.pacer, ticket, inner)
