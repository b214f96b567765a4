"""Per-tenant request and LLM-token quotas: token buckets, refusals and rate-limit headers.

Each tenant with limits has two token buckets (the SDK's, :mod:`llm_backoff.ratelimit`):
``requests`` (``requests_per_minute / 60`` per second, burst one minute's worth, as
OpenAI's per-minute limits allow) and ``tokens`` (LLM tokens, same shape). A request
is charged 1 request and its estimated tokens (:func:`llm_backoff.tokens.estimate_tokens`:
prompt + ``max_tokens``), all or nothing across both buckets; when the response
reports ``usage`` the difference is given back or charged
(:meth:`TenantQuotas.settle`).

The buckets go through the SDK's ``BucketStore`` seam: :class:`llm_backoff.ratelimit.LocalStore`
in this process, or :class:`llm_backoff.redis_bucket.RedisStore` with ``--redis-url``, whose
Lua script reserves atomically on the Redis clock, so several shims behind one load
balancer enforce one quota. (A pair of ``TokenBucket`` objects could not take from
both buckets atomically; the store does, with the same arithmetic.) Redis calls run
in a worker thread with the synchronous client, because the store's asyncio client
would open one connection pool per tenant.

Answers carry OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` and
the IETF draft's ``RateLimit-Policy`` / ``RateLimit`` fields (draft-ietf-httpapi-ratelimit-headers),
on refusals (429, ``code: tenant_rate_limited``, ``Retry-After`` = the time until the
bucket holds enough again) and on successes alike.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llm_backoff.errors import RateLimitTimeout
from llm_backoff.ratelimit import BucketSpec, BucketStore, LocalStore
from llm_backoff_shim.decide.tenants import Tenant, key_hash

Clock = Callable[[], float]
RawHeaders = list[tuple[bytes, bytes]]

#: Local buckets kept for at most this many tenants (least recently used evicted).
MAX_LOCAL_TENANTS = 10_000
#: Seconds a Redis connect or reply may take before the request gets its 503: a quota check
#: sits before the queue, and a Redis that hangs (stopped, partitioned) must not hold callers
#: (redis-py waits 5 s by default since 8.0, and without limit before). ``?socket_timeout=`` and
#: ``?socket_connect_timeout=`` in ``--redis-url`` override it.
REDIS_TIMEOUT = 0.5


def specs_for(tenant: Tenant) -> tuple[BucketSpec, ...]:
    """The buckets a tenant's limits call for (none: not limited)."""
    specs = []
    rpm, tpm = tenant.limits.requests_per_minute, tenant.limits.tokens_per_minute
    if rpm:
        specs.append(BucketSpec("requests", "requests", rpm / 60.0, rpm))
    if tpm:
        specs.append(BucketSpec("tokens", "tokens", tpm / 60.0, tpm))
    return tuple(specs)


def amounts_for(specs: Sequence[BucketSpec], tokens: float) -> tuple[float, ...]:
    # An estimate above the burst would never be granted; usage corrects it afterwards.
    return tuple(1.0 if s.kind == "requests" else min(float(tokens), s.capacity) for s in specs)


def refill_wait(specs: Sequence[BucketSpec], levels: Sequence[float], amounts: Sequence[float]) -> float:
    """Seconds until every bucket holds its amount again."""
    return max(
        (
            max(0.0, amount - level) / spec.rate
            for spec, level, amount in zip(specs, levels, amounts, strict=True)
        ),
        default=0.0,
    )


def reset_duration(seconds: float) -> str:
    """OpenAI's reset format: ``"20ms"``, ``"1.5s"``, ``"6m0s"``, ``"1h2m3s"``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000 - 1e-6))}ms"
    total = math.ceil(seconds * 1000 - 1e-6) / 1000
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes:
        return f"{int(minutes)}m{text}"
    return text


def quota_headers(specs: Sequence[BucketSpec], levels: Sequence[float]) -> RawHeaders:
    """OpenAI-style and IETF-draft rate-limit fields for buckets at ``levels`` (tokens now)."""
    headers: RawHeaders = []
    policy, state = [], []
    for spec, level in zip(specs, levels, strict=True):
        per_minute = spec.rate * 60.0
        remaining = max(0, math.floor(level + 1e-9))
        to_full = max(0.0, spec.capacity - level) / spec.rate
        headers += [
            (f"x-ratelimit-limit-{spec.name}".encode(), f"{per_minute:g}".encode()),
            (f"x-ratelimit-remaining-{spec.name}".encode(), str(remaining).encode()),
            (f"x-ratelimit-reset-{spec.name}".encode(), reset_duration(to_full).encode()),
        ]
        policy.append(f'"{spec.name}";q={math.floor(spec.capacity)};w={math.ceil(spec.capacity / spec.rate)}')
        state.append(f'"{spec.name}";r={remaining};t={math.ceil(to_full - 1e-9)}')
    if policy:
        headers += [
            (b"ratelimit-policy", ", ".join(policy).encode()),
            (b"ratelimit", ", ".join(state).encode()),
        ]
    return headers


@dataclass
class Charge:
    """What one admitted request took from its tenant's buckets, to be settled once."""

    store: BucketStore | None
    specs: tuple[BucketSpec, ...]
    amounts: tuple[float, ...]
    settled: bool = False

    @property
    def tokens(self) -> float:
        return sum(a for s, a in zip(self.specs, self.amounts, strict=True) if s.kind == "tokens")


@dataclass(frozen=True)
class QuotaDecision:
    """``granted`` or not; ``retry_after`` when refused; headers for the answer either way."""

    granted: bool
    retry_after: float
    headers: RawHeaders
    charge: Charge


def _try_take(store: BucketStore, amounts: Sequence[float]) -> tuple[bool, list[float]]:
    try:
        store.reserve(amounts, 0.0)
        granted = True
    except RateLimitTimeout:
        granted = False
    return granted, store.available()


class TenantQuotas:
    """The buckets of every tenant, in this process or in Redis (module docstring)."""

    def __init__(self, *, clock: Clock, redis_url: str | None = None, redis_client: Any = None) -> None:
        self._clock = clock
        self._redis_url = redis_url
        self._redis_client = redis_client
        self._owns_client = redis_client is None
        self._stores: OrderedDict[tuple[str, tuple[BucketSpec, ...]], BucketStore] = OrderedDict()
        if redis_url is not None and redis_client is None:
            import redis

            self._redis_client = redis.Redis.from_url(
                redis_url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT
            )

    @property
    def shared(self) -> bool:
        return self._redis_url is not None

    def _store(self, tenant: Tenant, specs: tuple[BucketSpec, ...]) -> BucketStore:
        key = (tenant.id, specs)
        store = self._stores.get(key)
        if store is not None:
            self._stores.move_to_end(key)
            return store
        if self._redis_url is not None:
            from llm_backoff.redis_bucket import RedisStore, bucket_key

            # Hashed again so that any header value makes a safe, fixed-length key.
            base = "llm-backoff-shim:tenant:" + key_hash(tenant.id)
            store = RedisStore(
                self._redis_url, [bucket_key(base, s.name) for s in specs], specs, client=self._redis_client
            )
        else:
            store = LocalStore(specs, self._clock)
            if len(self._stores) >= MAX_LOCAL_TENANTS:
                # Forgetting a bucket refills it; only the least recently seen tenant pays that.
                self._stores.popitem(last=False)
        self._stores[key] = store
        return store

    async def take(self, tenant: Tenant, estimated_tokens: float) -> QuotaDecision:
        """Charge one request and its token estimate, or refuse without charging anything."""
        specs = specs_for(tenant)
        if not specs:
            return QuotaDecision(True, 0.0, [], Charge(None, (), ()))
        store = self._store(tenant, specs)
        amounts = amounts_for(specs, estimated_tokens)
        if self.shared:
            granted, levels = await asyncio.to_thread(_try_take, store, amounts)
        else:
            granted, levels = _try_take(store, amounts)
        headers = quota_headers(specs, levels)
        if granted:
            return QuotaDecision(True, 0.0, headers, Charge(store, specs, amounts))
        wait = refill_wait(specs, levels, amounts)
        return QuotaDecision(False, wait, headers, Charge(store, specs, (0.0,) * len(specs), settled=True))

    async def settle(
        self, charge: Charge, *, served: bool, status: int | None, used_tokens: int | None
    ) -> None:
        """Correct a charge once the answer is known.

        Not served (the shim turned the request away after charging it): everything
        back. ``usage`` reported: tokens corrected to it. An error answer without
        usage: the token estimate back (nothing was generated). Otherwise (a broken
        stream, no usage): the estimate stands.
        """
        if charge.settled or charge.store is None:
            return
        charge.settled = True
        if not served:
            adjust = charge.amounts
        else:
            if used_tokens is not None:
                surplus = charge.tokens - used_tokens
            elif status is not None and status >= 400:
                surplus = charge.tokens
            else:
                surplus = 0.0
            adjust = tuple(surplus if s.kind == "tokens" else 0.0 for s in charge.specs)
        if not any(adjust):
            return
        if self.shared:
            await asyncio.to_thread(charge.store.adjust, adjust)
        else:
            charge.store.adjust(adjust)

    def close(self) -> None:
        if self._owns_client and self._redis_client is not None:
            self._redis_client.close()
