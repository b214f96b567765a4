"""Client-side token buckets: :class:`TokenBucket` and :class:`RateLimiter`.

How waiting works (one state machine for threads and tasks)
------------------------------------------------------------
The buckets use *reservation*, as Guava's ``RateLimiter`` and Go's
``golang.org/x/time/rate`` do: under a short lock, a caller computes when its
tokens will exist, takes them at once (the balance may go negative, which is a
queue of promises), and then sleeps that long *outside* the lock, with
``time.sleep`` in a thread or ``asyncio.sleep`` in a task. Consequences:

- **FIFO by construction.** Whoever reserves first is served first; a large
  request is never starved by a stream of small ones, because the small ones
  queue behind its debt (``try_acquire`` fails while anyone is waiting).
- **Sync and async share the same code** up to the final sleep; no thread per
  waiter, no wake-up bookkeeping, and a limiter can be shared by threads and by
  tasks of several event loops at once.
- **Timeouts fail fast.** When the computed wait exceeds ``timeout`` nothing is
  taken and :class:`~llm_backoff.errors.RateLimitTimeout` is raised immediately,
  instead of sleeping until the timeout only to fail then.
- **Nothing leaks.** A waiter that is cancelled or interrupted while sleeping
  gives its tokens back.

Rate changes (the adaptive limiter) apply to debt not yet repaid: waiters already
sleeping keep their slot, later arrivals wait at the new rate.

Why not pyrate-limiter: see ``docs/ratelimiting.md`` (it polls instead of
queueing, so it is not FIFO; it has no way to give tokens back or charge extra,
which the usage correction needs; its Redis bucket uses client clocks).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from llm_backoff.adaptive import THROTTLE_STATUSES, AdaptiveRate
from llm_backoff.errors import LLMBackoffError, RateLimitTimeout
from llm_backoff.limits import RequestInfo
from llm_backoff.tokens import DEFAULT_MAX_TOKENS, estimate_tokens, usage_tokens

Clock = Callable[[], float]

_NUMBER_TYPES = (int, float)

# Waits below this are float noise from refill arithmetic, not real waits.
_EPSILON = 1e-9


class RequestTooLargeError(LLMBackoffError, ValueError):
    """A single acquire asks for more than the bucket's capacity: it could never be granted."""


def _check_rate(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_amount(amount: float, capacity: float) -> float:
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise TypeError(f"amount must be a number, got {type(amount).__name__}")
    if not (amount >= 0 and math.isfinite(amount)):
        raise ValueError(f"amount must be a finite number >= 0, got {amount!r}")
    if amount > capacity:
        raise RequestTooLargeError(
            f"cannot acquire {amount:g} tokens from a bucket of capacity {capacity:g}: "
            "it would never be granted"
        )
    return float(amount)


@dataclass(slots=True)
class BucketState:
    """The pure arithmetic of one token bucket (no lock, no clock of its own).

    ``tokens`` may be negative: that is debt reserved by callers who are waiting.
    """

    rate: float
    capacity: float
    tokens: float
    updated: float

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def delay(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` tokens exist (0 if they exist now)."""
        self.refill(now)
        missing = amount - self.tokens
        return missing / self.rate if missing > _EPSILON * self.rate else 0.0

    def take(self, amount: float) -> None:
        self.tokens -= amount

    def give(self, amount: float) -> None:
        self.tokens = min(self.capacity, self.tokens + amount)

    def set_rate(self, rate: float, capacity: float, now: float) -> None:
        self.refill(now)
        self.rate = rate
        self.capacity = capacity
        self.tokens = min(self.tokens, capacity)


def reserve_all(pairs: Sequence[tuple[BucketState, float]], now: float, timeout: float | None) -> float:
    """Reserve ``amount`` from every bucket, all or nothing; return the wait in seconds.

    Raises :class:`RateLimitTimeout` (taking nothing) when the wait exceeds ``timeout``.
    A negative ``timeout`` (a deadline already passed) is treated as 0.
    """
    wait = 0.0
    for bucket, amount in pairs:
        wait = max(wait, bucket.delay(amount, now))
    if timeout is not None and wait > max(timeout, 0.0):
        raise RateLimitTimeout(
            f"client-side rate limit: the call could go out in {wait:.3f} s, "
            f"beyond the {max(timeout, 0.0):.3f} s left"
        )
    for bucket, amount in pairs:
        bucket.take(amount)
    return wait


def _sleep_or_give_back(wait: float, give_back: Callable[[], None]) -> None:
    if wait <= 0:
        return
    try:
        time.sleep(wait)
    except BaseException:
        give_back()
        raise


async def _async_sleep_or_give_back(wait: float, give_back: Callable[[], None]) -> None:
    if wait <= 0:
        return
    try:
        await asyncio.sleep(wait)
    except BaseException:
        give_back()
        raise


class TokenBucket:
    """``rate`` tokens per second, at most ``capacity`` stored (the burst).

    Thread-safe and task-safe; waiters are served in arrival order. The bucket
    starts full. ``clock`` must be monotonic (tests pass a fake one).
    """

    def __init__(self, rate: float, capacity: float, *, clock: Clock = time.monotonic) -> None:
        rate = _check_rate("rate", rate)
        capacity = _check_rate("capacity", capacity)
        self._clock = clock
        self._state = BucketState(rate, capacity, capacity, clock())
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TokenBucket(rate={self._state.rate:g}, capacity={self._state.capacity:g})"

    @property
    def rate(self) -> float:
        return self._state.rate

    @property
    def capacity(self) -> float:
        return self._state.capacity

    @property
    def available(self) -> float:
        """Tokens available now; negative while reserved tokens are still owed to waiters."""
        with self._lock:
            self._state.refill(self._clock())
            return self._state.tokens

    def reserve(self, amount: float = 1, timeout: float | None = None) -> float:
        """Take ``amount`` now, to be used after the returned number of seconds.

        The building block of :meth:`acquire` (the caller must wait the returned
        delay, or :meth:`refund` the tokens if it gives up).
        """
        amount = _check_amount(amount, self._state.capacity)
        with self._lock:
            return reserve_all(((self._state, amount),), self._clock(), timeout)

    def try_acquire(self, amount: float = 1) -> bool:
        """Take ``amount`` if available right now and nobody is queued; never blocks."""
        # The hot path of every limiter: validation and refill are inlined (about
        # half the cost of calling the helpers); anything unusual (NaN, bool, too
        # large) takes the slow path, which raises the clear error.
        state = self._state
        if not (type(amount) in _NUMBER_TYPES and 0 <= amount <= state.capacity):
            amount = _check_amount(amount, state.capacity)
        with self._lock:
            now = self._clock()
            if now > state.updated:
                tokens = state.tokens + (now - state.updated) * state.rate
                state.tokens = tokens if tokens < state.capacity else state.capacity
                state.updated = now
            if state.tokens >= amount:
                state.tokens -= amount
                return True
            return False

    def acquire(self, amount: float = 1, timeout: float | None = None) -> float:
        """Block until ``amount`` tokens are granted; return the seconds waited.

        Raises :class:`RateLimitTimeout` at once when they cannot be granted within
        ``timeout`` seconds, and :class:`RequestTooLargeError` when ``amount > capacity``.
        """
        wait = self.reserve(amount, timeout)
        _sleep_or_give_back(wait, lambda: self.refund(amount))
        return wait

    async def acquire_async(self, amount: float = 1, timeout: float | None = None) -> float:
        """:meth:`acquire` for asyncio: waits with ``asyncio.sleep``; cancelling gives the tokens back."""
        wait = self.reserve(amount, timeout)
        await _async_sleep_or_give_back(wait, lambda: self.refund(amount))
        return wait

    def refund(self, amount: float) -> None:
        """Give back tokens that were taken but not used (never beyond capacity)."""
        if amount > 0:
            with self._lock:
                self._state.refill(self._clock())
                self._state.give(amount)

    def charge(self, amount: float) -> None:
        """Take tokens without waiting (may go into debt that later callers wait for)."""
        if amount > 0:
            with self._lock:
                self._state.refill(self._clock())
                self._state.take(amount)

    def set_rate(self, rate: float, capacity: float | None = None) -> None:
        rate = _check_rate("rate", rate)
        capacity = self._state.capacity if capacity is None else _check_rate("capacity", capacity)
        with self._lock:
            self._state.set_rate(rate, capacity, self._clock())


# --------------------------------------------------------------------------- limiter


LimitKind = Literal["requests", "tokens"]


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One limit of a :class:`RateLimiter`: ``name`` is also its Redis key suffix."""

    name: str
    kind: LimitKind
    rate: float
    capacity: float


class BucketStore(Protocol):
    """Where a limiter's buckets live: in this process, or in Redis."""

    def reserve(self, amounts: Sequence[float], timeout: float | None) -> float: ...

    async def reserve_async(self, amounts: Sequence[float], timeout: float | None) -> float: ...

    def adjust(self, amounts: Sequence[float]) -> None:
        """Give back (positive) or charge without waiting (negative) per bucket."""

    def available(self) -> list[float]:
        """Tokens in each bucket now (negative: owed to waiters)."""


class LocalStore:
    """The buckets of a limiter held in this process, under one lock."""

    def __init__(self, specs: Sequence[BucketSpec], clock: Clock) -> None:
        now = clock()
        self._buckets = [BucketState(s.rate, s.capacity, s.capacity, now) for s in specs]
        self._clock = clock
        self._lock = threading.Lock()

    def reserve(self, amounts: Sequence[float], timeout: float | None) -> float:
        with self._lock:
            return reserve_all(tuple(zip(self._buckets, amounts, strict=True)), self._clock(), timeout)

    async def reserve_async(self, amounts: Sequence[float], timeout: float | None) -> float:
        return self.reserve(amounts, timeout)

    def adjust(self, amounts: Sequence[float]) -> None:
        with self._lock:
            now = self._clock()
            for bucket, amount in zip(self._buckets, amounts, strict=True):
                if amount:
                    bucket.refill(now)
                    if amount > 0:
                        bucket.give(amount)
                    else:
                        bucket.take(-amount)

    def available(self) -> list[float]:
        with self._lock:
            now = self._clock()
            for bucket in self._buckets:
                bucket.refill(now)
            return [b.tokens for b in self._buckets]


StoreFactory = Callable[[Sequence[BucketSpec], Clock], BucketStore]


class LimiterPermit:
    """The grant for one call; :meth:`settle` it once with how the call ended."""

    __slots__ = ("_limiter", "_settled", "amounts", "estimated_tokens")

    def __init__(self, limiter: RateLimiter, amounts: tuple[float, ...], estimated_tokens: float) -> None:
        self._limiter = limiter
        self.amounts = amounts
        self.estimated_tokens = estimated_tokens
        self._settled = False

    def settle(self, *, status: int | None, body: bytes | None) -> None:
        """Correct the token charge from ``usage`` and feed the adaptive rate.

        Idempotent: a second call does nothing (the protocol says exactly once; a
        double call must not refund twice).
        """
        if self._settled:
            return
        self._settled = True
        self._limiter._settle(self, status, body)


def _optional_rate(name: str, value: float | None) -> float | None:
    return None if value is None else _check_rate(name, value)


class RateLimiter:
    """Request and LLM-token limits for calls, shareable by clients, threads and tasks.

    Implements ``llm_backoff.limits.CallLimiter`` so ``wrap(client, limiter=...)``
    runs every attempt (retries included) through it.

    Limits (any combination; each one is a token bucket):

    - ``requests_per_second`` / ``requests_per_minute``: the long-run request rate.
    - ``tokens_per_minute``: LLM tokens; a call is charged its estimate
      (:func:`llm_backoff.tokens.estimate_tokens`) before it is sent, and the
      difference to the ``usage`` the server reports is given back or charged
      afterwards. An estimate above the bucket's capacity is capped at the capacity
      (the heuristic may overestimate; the server is the judge).
    - ``burst``: how many requests may go out back to back. By default each
      bucket holds one period's worth (``requests_per_minute=60`` allows 60 at
      once, then one per second, as ``aiolimiter`` does); pass a smaller ``burst``
      to pace strictly against a server that counts in short windows.
    - ``adaptive=True``: additionally follow the server's throttling
      (:class:`llm_backoff.adaptive.AdaptiveRate`, the AWS SDKs' CUBIC scheme): no
      limit until the first 429/503, then multiplicative decrease and cubic
      recovery, never above the request limits configured here (if any) and never
      below ``min_rate`` requests per second. The adaptive state is per process
      even when the fixed limits live in Redis.

    A call that fails without a response keeps its token charge (it may have
    reached the model); an error response without ``usage`` (4xx/5xx) gives the
    token estimate back, since the server generated nothing.
    """

    def __init__(
        self,
        requests_per_second: float | None = None,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
        burst: float | None = None,
        *,
        adaptive: bool = False,
        min_rate: float = 0.5,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        clock: Clock = time.monotonic,
        store_factory: StoreFactory | None = None,
    ) -> None:
        rps = _optional_rate("requests_per_second", requests_per_second)
        rpm = _optional_rate("requests_per_minute", requests_per_minute)
        tpm = _optional_rate("tokens_per_minute", tokens_per_minute)
        burst = _optional_rate("burst", burst)
        min_rate = _check_rate("min_rate", min_rate)
        if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int):
            raise TypeError("default_max_tokens must be an int")
        if default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be >= 0, got {default_max_tokens}")
        if rps is None and rpm is None and tpm is None and not adaptive:
            raise ValueError(
                "RateLimiter needs at least one of requests_per_second, requests_per_minute, "
                "tokens_per_minute, or adaptive=True"
            )
        specs: list[BucketSpec] = []
        if rps is not None:
            specs.append(BucketSpec("requests_per_second", "requests", rps, burst or max(1.0, rps)))
        if rpm is not None:
            specs.append(BucketSpec("requests_per_minute", "requests", rpm / 60.0, burst or max(1.0, rpm)))
        if tpm is not None:
            specs.append(BucketSpec("tokens_per_minute", "tokens", tpm / 60.0, tpm))
        self.specs: tuple[BucketSpec, ...] = tuple(specs)
        self.default_max_tokens = default_max_tokens
        self._clock = clock
        self._store: BucketStore = (store_factory or LocalStore)(self.specs, clock)
        self._is_token = tuple(s.kind == "tokens" for s in self.specs)
        self._token_capacity = min((s.capacity for s in self.specs if s.kind == "tokens"), default=math.inf)
        self._lock = threading.Lock()
        self._adaptive: AdaptiveRate | None = None
        self._adaptive_bucket: BucketState | None = None
        if adaptive:
            ceiling = min((s.rate for s in self.specs if s.kind == "requests"), default=math.inf)
            self._adaptive = AdaptiveRate(clock=clock, ceiling=max(ceiling, min_rate), floor=min_rate)

    def __repr__(self) -> str:
        limits = ", ".join(f"{s.name}: {s.rate:g}/s burst {s.capacity:g}" for s in self.specs)
        return f"RateLimiter({limits}{', adaptive' if self._adaptive else ''})"

    @property
    def adaptive_rate(self) -> float | None:
        """The enforced adaptive rate (requests/s), or None while unthrottled / not adaptive."""
        with self._lock:
            if self._adaptive is None or not self._adaptive.enabled:
                return None
            return self._adaptive.rate

    def available(self) -> dict[str, float]:
        """Tokens in each fixed bucket now, by limit name (negative: owed to waiters)."""
        return dict(zip((s.name for s in self.specs), self._store.available(), strict=True))

    # -- pricing

    def estimate(self, request: RequestInfo) -> int:
        """LLM tokens a request is charged before it is sent."""
        url = getattr(request, "url", None)
        path = str(getattr(url, "path", "") or "")
        return estimate_tokens(request.content, default_max_tokens=self.default_max_tokens, path=path)

    def _amounts(self, tokens: float) -> tuple[tuple[float, ...], float]:
        if not (tokens >= 0 and math.isfinite(tokens)):
            raise ValueError(f"tokens must be a finite number >= 0, got {tokens!r}")
        charged = min(float(tokens), self._token_capacity)
        return tuple(charged if t else 1.0 for t in self._is_token), charged

    # -- the adaptive bucket (always local)

    def _reserve_adaptive(self, timeout: float | None) -> float:
        if self._adaptive is None:
            return 0.0
        with self._lock:
            bucket = self._adaptive_bucket
            if bucket is None:
                return 0.0
            return reserve_all(((bucket, 1.0),), self._clock(), timeout)

    def _refund_adaptive(self) -> None:
        with self._lock:
            if self._adaptive_bucket is not None:
                self._adaptive_bucket.refill(self._clock())
                self._adaptive_bucket.give(1.0)

    def _reserve(self, amounts: tuple[float, ...], timeout: float | None, shared_wait: float) -> float:
        try:
            return max(shared_wait, self._reserve_adaptive(timeout))
        except BaseException:
            self._store.adjust(amounts)
            raise

    def _give_back(self, amounts: tuple[float, ...]) -> Callable[[], None]:
        def give_back() -> None:
            self._store.adjust(amounts)
            if self._adaptive is not None:
                self._refund_adaptive()

        return give_back

    # -- acquiring

    def acquire(self, tokens: float = 0, *, timeout: float | None = None) -> LimiterPermit:
        """Block until one request costing ``tokens`` LLM tokens may go out."""
        amounts, charged = self._amounts(tokens)
        wait = self._reserve(amounts, timeout, self._store.reserve(amounts, timeout))
        _sleep_or_give_back(wait, self._give_back(amounts))
        return LimiterPermit(self, amounts, charged)

    async def acquire_async(self, tokens: float = 0, *, timeout: float | None = None) -> LimiterPermit:
        amounts, charged = self._amounts(tokens)
        wait = self._reserve(amounts, timeout, await self._store.reserve_async(amounts, timeout))
        await _async_sleep_or_give_back(wait, self._give_back(amounts))
        return LimiterPermit(self, amounts, charged)

    def try_acquire(self, tokens: float = 0) -> LimiterPermit | None:
        """A permit if the call may go out right now, else None; never blocks."""
        try:
            return self.acquire(tokens, timeout=0.0)
        except RateLimitTimeout:
            return None

    def acquire_for(self, request: RequestInfo, *, timeout: float | None) -> LimiterPermit:
        return self.acquire(self.estimate(request), timeout=timeout)

    async def acquire_for_async(self, request: RequestInfo, *, timeout: float | None) -> LimiterPermit:
        return await self.acquire_async(self.estimate(request), timeout=timeout)

    # -- after the call

    def _settle(self, permit: LimiterPermit, status: int | None, body: bytes | None) -> None:
        if any(self._is_token):
            actual = usage_tokens(body)
            if actual is not None:
                surplus = permit.estimated_tokens - actual
            elif status is not None and status >= 400:
                surplus = permit.estimated_tokens
            else:
                surplus = 0.0
            if surplus:
                self._store.adjust(tuple(surplus if t else 0.0 for t in self._is_token))
        if self._adaptive is not None and status is not None:
            self._feed_adaptive(throttled=status in THROTTLE_STATUSES)

    def _feed_adaptive(self, *, throttled: bool) -> None:
        assert self._adaptive is not None
        with self._lock:
            rate = self._adaptive.on_response(throttled=throttled)
            if not self._adaptive.enabled:
                return
            # As in botocore's token bucket: about one second's worth of burst.
            capacity = max(1.0, rate)
            now = self._clock()
            if self._adaptive_bucket is None:
                # Start empty: the throttle says we are already too fast.
                self._adaptive_bucket = BucketState(rate, capacity, 0.0, now)
            else:
                self._adaptive_bucket.set_rate(rate, capacity, now)
