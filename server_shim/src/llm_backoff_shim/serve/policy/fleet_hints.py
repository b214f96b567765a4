"""The fleet's Retry-After: replicas refusing one call answer the soonest replica's wait.

Behind nginx or HAProxy set to ask another replica when one refuses (docs/deploy.md, "A
fleet"), a call the whole fleet refuses is refused by each replica in turn, and the load
balancer passes on the last answer unchanged. The right answer for the fleet is the soonest
replica's wait (a retry through the load balancer finds that replica's slot); the last
replica's is as likely the busiest one's (measured 5x and 10.6x the soonest with replicas
of unequal load). No stock nginx or HAProxy feature sees every replica's answer to a call,
so the replicas share them, keyed by the call's ``X-Request-Id`` (the shipped load-balancer
configurations give every call one, the same on every try), in the Redis the tenant quotas
already use: each refusing replica adds its own return time to the call's record and answers
the soonest of the record, so the replica asked last answers the soonest of all.

One script, on the Redis clock (replicas on several hosts need not agree on the time): the
record is a hash of replica id to the return time in Redis milliseconds, expiring a few
seconds after the last refusal (a call's tries follow each other within milliseconds). It also
answers how many replicas the record holds, from which :class:`FleetSize` learns the fleet.

Redis is on the refusal path, so it may cost little: each call is given :data:`TIMEOUT`
(250 ms; ``?socket_timeout=`` in ``--redis-url`` overrides it, as for the quotas), and after a
failure the replica answers with its own hint (the documented answer without the fleet) for
``pause`` seconds before asking Redis again, so a Redis that hangs costs one refusal in
``pause`` a delay, not every one. A call without a request id is answered alone.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from typing import Any

from llm_backoff_shim.decide.fleet_size import FleetSize

log = logging.getLogger("llm_backoff_shim.fleet")

#: Seconds a call to Redis may take on the refusal path before the replica answers alone: a
#: loopback round trip takes well under a millisecond, but the shim's own event loop reads the
#: reply, and on a loaded 2-core machine 100 ms was exceeded (the fallback then answered alone).
TIMEOUT = 0.25
#: Seconds the replica answers alone after Redis failed, before it asks Redis again.
PAUSE = 1.0
#: Milliseconds a call's record outlives its last refusal.
RECORD_TTL_MS = 10_000

# KEYS[1]: the call's record. ARGV: replica id, this replica's hint (ms), the record's TTL (ms).
# Returns {the soonest return in the record, ms from now (may be below this hint), replicas}.
_SOONEST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local at = now + tonumber(ARGV[2])
local mine = tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
if mine == nil or at < mine then
  redis.call('HSET', KEYS[1], ARGV[1], at)
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
local soonest = at
local times = redis.call('HVALS', KEYS[1])
for _, v in ipairs(times) do
  local x = tonumber(v)
  if x < soonest then soonest = x end
end
return {soonest - now, #times}
"""


def connect(url: str) -> Any:
    """A ``redis.asyncio.Redis`` for ``url``, with :data:`TIMEOUT` unless the URL sets its own."""
    import redis.asyncio

    return redis.asyncio.Redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)


class FleetHints:
    """The soonest wait among the replicas that refused a call (module docstring).

    ``client``: a ``redis.asyncio.Redis``; ``minimum``: the least hint to give
    (``--retry-after-min``); ``fleet``: told how many replicas refused each call.
    """

    def __init__(
        self,
        client: Any,
        *,
        fleet: FleetSize,
        clock: Callable[[], float],
        minimum: float,
        prefix: str = "llm-backoff:hint:",
        pause: float = PAUSE,
    ) -> None:
        self._client = client
        self._script = client.register_script(_SOONEST)
        self._fleet = fleet
        self._clock = clock
        self._minimum = minimum
        self._prefix = prefix
        self._pause = pause
        self._quiet_until = -math.inf
        #: This replica's field in each call's record: random, so replicas need no configuration.
        self.replica_id = secrets.token_hex(8)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> FleetHints:
        return cls(connect(url), **kwargs)

    @property
    def client(self) -> Any:
        """The Redis client, for the fleet's other records (fleet_attempts.py); closed by :meth:`close`."""
        return self._client

    async def soonest(self, request_id: str | None, hint: float) -> float:
        """The hint to answer for a call this replica refuses with ``hint`` (seconds): the
        soonest among the replicas that refused it so far, this one included; ``hint`` itself
        when the call has no id or Redis does not answer (module docstring)."""
        if request_id is None or self._clock() < self._quiet_until:
            return hint
        try:
            reply = await self._script(
                keys=[self._prefix + request_id], args=[self.replica_id, round(hint * 1000), RECORD_TTL_MS]
            )
            soonest_ms, replicas = int(reply[0]), int(reply[1])
        except Exception as exc:  # any failure of the store: answer alone
            self._quiet_until = self._clock() + self._pause
            log.warning(
                "fleet hints: Redis failed (%s: %s); answering alone for %.0f s",
                type(exc).__name__,
                exc,
                self._pause,
            )
            return hint
        self._fleet.observe(replicas)
        return min(hint, max(self._minimum, soonest_ms / 1000))

    async def close(self) -> None:
        # ``aclose`` from redis-py 5.0.1; ``close`` before it (deprecated after).
        closer = getattr(self._client, "aclose", None) or self._client.close
        await closer()
