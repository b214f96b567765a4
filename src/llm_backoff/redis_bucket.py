"""Token buckets in Redis, shared by many processes and hosts.

``pip install llm-backoff[redis]``. Same behaviour as the in-process buckets
(:mod:`llm_backoff.ratelimit`), same reservation scheme, so the same FIFO and
fail-fast timeout properties hold across processes:

- **Atomic.** Every acquire is one ``EVALSHA`` of :data:`RESERVE_SCRIPT` that
  refills, checks and reserves all of a limiter's buckets at once (all or nothing).
- **No clock skew.** Time is Redis' ``TIME``, read inside the script; clients only
  ever sleep a *relative* wait that the script returns, so hosts with different
  clocks share one limit correctly. If the Redis clock steps back, buckets simply
  do not refill until it catches up.
- **Self-cleaning.** A bucket's key expires once it would be full again (a missing
  key means "full"), so idle limits cost no memory.
- **Cheap corrections.** Usage corrections and cancelled waits are sent at once from
  synchronous code; from inside an event loop (where a blocking round trip would
  stall the loop) they are queued and ride along with the next acquire's script
  call, or are sent by :meth:`RedisStore.flush` / ``aflush``.

A Redis failure raises the ``redis`` client's exception (``redis.ConnectionError``
...): a shared limit that cannot be checked is not silently exceeded.

Async clients (``redis.asyncio``) are bound to one event loop, so one is created per
loop on first use; ``aclose()`` closes the current loop's client, ``close()`` the
synchronous one.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from llm_backoff.errors import RateLimitTimeout
from llm_backoff.ratelimit import (
    BucketSpec,
    Clock,
    RateLimiter,
    _async_sleep_or_give_back,
    _check_amount,
    _check_rate,
    _sleep_or_give_back,
)

RESERVE_SCRIPT = """
-- KEYS[i]: hash {t = last update (Redis server seconds), v = tokens} of bucket i.
-- ARGV[1]: longest acceptable wait in seconds ("-1": any).
-- ARGV[2 + 4*(i-1) ..]: rate, capacity, adjust, amount for bucket i.
-- 'adjust' is applied first (positive gives tokens back, negative charges debt),
-- then 'amount' is reserved from every bucket if the wait is acceptable.
-- Returns {granted (1|0), wait, tokens_1, ..., tokens_n} (numbers as strings).
pcall(redis.replicate_commands)
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local max_wait = tonumber(ARGV[1])
local n = #KEYS
local tokens, stamps = {}, {}
local wait = 0
for i = 1, n do
  local b = 2 + 4 * (i - 1)
  local rate, capacity = tonumber(ARGV[b]), tonumber(ARGV[b + 1])
  local adjust, amount = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local state = redis.call('HMGET', KEYS[i], 't', 'v')
  local t, v = tonumber(state[1]), tonumber(state[2])
  if t == nil or v == nil then
    t, v = now, capacity
  end
  if now > t then
    v = math.min(capacity, v + (now - t) * rate)
    t = now
  end
  v = math.min(capacity, v + adjust)
  tokens[i], stamps[i] = v, t
  local missing = amount - v
  if missing > 1e-9 * rate then
    wait = math.max(wait, missing / rate)
  end
end
local granted = 1
if max_wait >= 0 and wait > max_wait then
  granted = 0
end
local out = {granted, string.format('%.17g', wait)}
for i = 1, n do
  local b = 2 + 4 * (i - 1)
  local rate, capacity = tonumber(ARGV[b]), tonumber(ARGV[b + 1])
  local adjust, amount = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local v = tokens[i]
  if granted == 1 then
    v = v - amount
  end
  if granted == 1 or adjust ~= 0 then
    redis.call('HSET', KEYS[i], 't', string.format('%.17g', stamps[i]), 'v', string.format('%.17g', v))
    local ttl = math.min(2000000000, math.ceil((capacity - v) / rate * 1000) + 1000)
    redis.call('PEXPIRE', KEYS[i], string.format('%.0f', ttl))
  end
  out[#out + 1] = string.format('%.17g', v)
end
return out
"""


def _import_redis() -> Any:
    try:
        import redis
        import redis.asyncio
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "Redis-backed limits need the redis client: pip install 'llm-backoff[redis]'"
        ) from exc
    return redis


class RedisStore:
    """The buckets of one limiter in Redis (a ``BucketStore`` for :class:`RateLimiter`)."""

    def __init__(
        self, url: str, keys: Sequence[str], specs: Sequence[BucketSpec], *, client: Any = None
    ) -> None:
        redis = _import_redis()
        if len(keys) != len(specs):
            raise ValueError("one Redis key per bucket")
        self._redis = redis
        self._url = url
        self._owns_client = client is None
        self._client = client if client is not None else redis.Redis.from_url(url)
        self._script = self._client.register_script(RESERVE_SCRIPT)
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self.keys = tuple(keys)
        self._specs = tuple(specs)
        self._pending = [0.0] * len(specs)
        self._lock = threading.Lock()

    def _take_pending(self) -> list[float]:
        with self._lock:
            pending, self._pending = self._pending, [0.0] * len(self._specs)
        return pending

    def _restore_pending(self, pending: Sequence[float]) -> None:
        with self._lock:
            self._pending = [a + b for a, b in zip(self._pending, pending, strict=True)]

    def _args(self, max_wait: float, adjust: Sequence[float], amounts: Sequence[float]) -> list[str]:
        args = [repr(max_wait)]
        for spec, adj, amount in zip(self._specs, adjust, amounts, strict=True):
            args += [repr(spec.rate), repr(spec.capacity), repr(float(adj)), repr(float(amount))]
        return args

    @staticmethod
    def _parse(reply: Sequence[Any], timeout: float | None) -> tuple[float, list[float]]:
        wait = float(reply[1])
        if not int(reply[0]):
            limit = max(timeout or 0.0, 0.0)
            raise RateLimitTimeout(
                f"shared rate limit: the call could go out in {wait:.3f} s, beyond the {limit:.3f} s left"
            )
        return wait, [float(v) for v in reply[2:]]

    @staticmethod
    def _max_wait(timeout: float | None) -> float:
        return -1.0 if timeout is None else max(timeout, 0.0)

    def _run(
        self, max_wait: float, amounts: Sequence[float], timeout: float | None
    ) -> tuple[float, list[float]]:
        pending = self._take_pending()
        try:
            reply = self._script(keys=self.keys, args=self._args(max_wait, pending, amounts))
        except BaseException:
            self._restore_pending(pending)
            raise
        return self._parse(reply, timeout)

    def _async_script(self) -> Any:
        loop = asyncio.get_running_loop()
        entry = self._async.get(loop)
        if entry is None:
            client = self._redis.asyncio.Redis.from_url(self._url)
            entry = (client, client.register_script(RESERVE_SCRIPT))
            self._async[loop] = entry
        return entry[1]

    async def _run_async(
        self, max_wait: float, amounts: Sequence[float], timeout: float | None
    ) -> tuple[float, list[float]]:
        script = self._async_script()
        pending = self._take_pending()
        call = asyncio.ensure_future(script(keys=self.keys, args=self._args(max_wait, pending, amounts)))
        try:
            reply = await asyncio.shield(call)
        except asyncio.CancelledError:
            # The script may have run on Redis already, corrections and reservation included:
            # its reply, not a guess, says what to give back, so nothing is applied twice or lost.
            await self._settle_cancelled(call, pending, amounts)
            raise
        except BaseException:
            self._restore_pending(pending)
            raise
        return self._parse(reply, timeout)

    async def _settle_cancelled(self, call: Any, pending: Sequence[float], amounts: Sequence[float]) -> None:
        """After a cancellation mid-call: wait for the script's reply (bounded by the client's
        own timeouts), then requeue the corrections if it did not run, or queue the refund of
        what it reserved if it did."""
        try:
            reply = await call
        except BaseException:
            self._restore_pending(pending)
            return
        if int(reply[0]):
            self._restore_pending([float(a) for a in amounts])

    # -- BucketStore

    def reserve(self, amounts: Sequence[float], timeout: float | None) -> float:
        return self._run(self._max_wait(timeout), amounts, timeout)[0]

    async def reserve_async(self, amounts: Sequence[float], timeout: float | None) -> float:
        return (await self._run_async(self._max_wait(timeout), amounts, timeout))[0]

    def adjust(self, amounts: Sequence[float]) -> None:
        self._restore_pending(amounts)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.flush()

    def available(self) -> list[float]:
        return self._run(-1.0, [0.0] * len(self._specs), None)[1]

    def flush(self) -> None:
        """Send queued corrections now (synchronously)."""
        if any(self._pending):
            self._run(-1.0, [0.0] * len(self._specs), None)

    async def aflush(self) -> None:
        if any(self._pending):
            await self._run_async(-1.0, [0.0] * len(self._specs), None)

    def close(self) -> None:
        """Send queued corrections, then close the synchronous client (if we made it)."""
        try:
            self.flush()
        finally:
            if self._owns_client:
                self._client.close()

    async def aclose(self) -> None:
        """Flush queued corrections and close the current event loop's async client."""
        await self.aflush()
        entry = self._async.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[0].aclose()


def bucket_key(key: str, name: str) -> str:
    # The hash tag keeps all of a limiter's keys in one Redis Cluster slot, which a
    # multi-key script requires.
    return f"{{{key}}}:{name}"


class RedisTokenBucket:
    """A :class:`~llm_backoff.ratelimit.TokenBucket` whose state lives in Redis under ``key``.

    Every process (or host) that builds one with the same ``url`` and ``key`` shares
    one budget of ``rate`` tokens per second, burst ``capacity``. All processes must
    use the same ``rate`` and ``capacity``: the values of the latest caller apply.
    """

    def __init__(self, url: str, key: str, rate: float, capacity: float, *, client: Any = None) -> None:
        rate = _check_rate("rate", rate)
        capacity = _check_rate("capacity", capacity)
        self.key = key
        self._spec = BucketSpec(key, "requests", rate, capacity)
        self._store = RedisStore(url, [bucket_key(key, "bucket")], [self._spec], client=client)

    def __repr__(self) -> str:
        return f"RedisTokenBucket(key={self.key!r}, rate={self.rate:g}, capacity={self.capacity:g})"

    @property
    def rate(self) -> float:
        return self._spec.rate

    @property
    def capacity(self) -> float:
        return self._spec.capacity

    @property
    def available(self) -> float:
        return self._store.available()[0]

    def reserve(self, amount: float = 1, timeout: float | None = None) -> float:
        amount = _check_amount(amount, self.capacity)
        return self._store.reserve((amount,), timeout)

    def try_acquire(self, amount: float = 1) -> bool:
        try:
            self.reserve(amount, 0.0)
        except RateLimitTimeout:
            return False
        return True

    def acquire(self, amount: float = 1, timeout: float | None = None) -> float:
        wait = self.reserve(amount, timeout)
        _sleep_or_give_back(wait, lambda: self.refund(amount))
        return wait

    async def acquire_async(self, amount: float = 1, timeout: float | None = None) -> float:
        amount = _check_amount(amount, self.capacity)
        wait = await self._store.reserve_async((amount,), timeout)
        await _async_sleep_or_give_back(wait, lambda: self.refund(amount))
        return wait

    def refund(self, amount: float) -> None:
        if amount > 0:
            self._store.adjust((float(amount),))

    def charge(self, amount: float) -> None:
        if amount > 0:
            self._store.adjust((-float(amount),))

    def close(self) -> None:
        self._store.close()

    async def aclose(self) -> None:
        await self._store.aclose()


class RedisRateLimiter(RateLimiter):
    """A :class:`~llm_backoff.ratelimit.RateLimiter` whose limits are shared through Redis.

    Same arguments as ``RateLimiter`` plus ``url`` and ``key``; every limiter built
    with the same ``key`` shares the same request and token budgets. The adaptive
    rate (``adaptive=True``) stays per process: it reacts to what this process sees.
    """

    def __init__(
        self,
        url: str,
        key: str,
        requests_per_second: float | None = None,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
        burst: float | None = None,
        *,
        client: Any = None,
        clock: Clock = time.monotonic,
        **kwargs: Any,
    ) -> None:
        self.key = key

        def factory(specs: Sequence[BucketSpec], _clock: Clock) -> RedisStore:
            return RedisStore(url, [bucket_key(key, s.name) for s in specs], specs, client=client)

        super().__init__(
            requests_per_second,
            requests_per_minute,
            tokens_per_minute,
            burst,
            clock=clock,
            store_factory=factory,
            **kwargs,
        )

    @property
    def store(self) -> RedisStore:
        assert isinstance(self._store, RedisStore)
        return self._store

    def close(self) -> None:
        self.store.close()

    async def aclose(self) -> None:
        await self.store.aclose()
