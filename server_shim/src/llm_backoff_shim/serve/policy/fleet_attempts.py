"""Callers' attempts counted once across the fleet: whether a replica's try is its attempt's first.

Behind nginx or HAProxy set to ask another replica when one refuses (docs/deploy.md, "A fleet"),
one caller's attempt is a try at each replica asked, so counting tries counts a call the whole
fleet refused once per replica asked, and a call served by the third replica asked as two
refusals and an admission. The replicas share a record per attempt in the Redis of the fleet's
hints (fleet_hints.py), so that each attempt is counted once, by the replica its first try
reached, and an attempt one replica refused and a later one admitted is counted as rescued:

- a refusing replica sets the record to its refusal's code unless it exists: set, this try is
  the attempt's first (an attempt refused, by that code); present, a later try (nothing);
- an admitting replica marks the record admitted: absent, this try is the first (an attempt
  admitted); holding a code, an earlier replica refused it (a rescue, by that code); marked,
  the attempt was admitted before (an engine's refusal after admission sent it on: nothing).

So over any window: callers' attempts = attempts counted; attempts the fleet refused = attempts
counted refused - rescues, by code. The record is keyed by the call's ``X-Request-Id`` and its
``X-Request-Start`` (the shipped load-balancer configurations give every call one id, the same
on every try, and stamp its arrival once per call): an SDK's retry that reuses the id is stamped
anew, a new attempt as its caller sees it. A try without an id, or one Redis does not answer in
time, counts as its own attempt: what a lone replica counts (tries are attempts), and after a
failure Redis is left alone for ``pause`` seconds, as for the hints.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llm_backoff_shim.serve.policy.fleet_hints import PAUSE, RECORD_TTL_MS

log = logging.getLogger("llm_backoff_shim.fleet")

#: The record's mark for an admitted attempt (a refusal's code never is).
_ADMITTED_MARK = "+"

# KEYS[1]: the attempt's record. ARGV: the refusal's code, the record's TTL (ms).
# Returns 1 when this refusal is the attempt's first try, else 0.
_REFUSED = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', tonumber(ARGV[2])) then
  return 1
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 0
"""

# KEYS[1]: the attempt's record. ARGV: the admitted mark, the record's TTL (ms).
# Returns what the record held before (nil: nothing, this try is the attempt's first).
_ADMITTED = """
local before = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
return before
"""


@dataclass(frozen=True, slots=True)
class Admission:
    """What an admitted try is to its attempt: the first try (``first``), a rescue of an
    attempt an earlier replica refused (``rescued_from``: that refusal's code), or neither."""

    first: bool
    rescued_from: str | None = None


def attempt_key(request_id: str | None, request_start: float | None) -> str | None:
    """The record's name for a caller's attempt: its request id and, when stamped, the load
    balancer's ``X-Request-Start`` to the millisecond; None without an id."""
    if request_id is None:
        return None
    if request_start is None:
        return request_id
    return f"{request_id}@{round(request_start * 1000)}"


class FleetAttempts:
    """Whether a try is its caller's attempt's first, from the fleet's shared record (module
    docstring). ``client``: a ``redis.asyncio.Redis`` (the fleet hints' own); ``ttl_ms``: how
    long a record outlives its last try, at least as long as a later replica may queue it."""

    def __init__(
        self,
        client: Any,
        *,
        clock: Callable[[], float],
        ttl_ms: int = RECORD_TTL_MS,
        prefix: str = "llm-backoff:attempt:",
        pause: float = PAUSE,
    ) -> None:
        self._refused = client.register_script(_REFUSED)
        self._admitted = client.register_script(_ADMITTED)
        self._clock = clock
        self._ttl_ms = ttl_ms
        self._prefix = prefix
        self._pause = pause
        self._quiet_until = -math.inf

    async def refused(self, key: str | None, code: str) -> bool:
        """Whether this refusal (``code``) is the first try of the attempt ``key``; True when
        there is no key or Redis does not answer (the try counts as its own attempt)."""
        reply = await self._ask(self._refused, key, code)
        return reply is None or int(reply) == 1

    async def admitted(self, key: str | None) -> Admission:
        """What this admission is to the attempt ``key`` (:class:`Admission`); the first try
        when there is no key or Redis does not answer."""
        reply = await self._ask(self._admitted, key, _ADMITTED_MARK)
        if reply is None:  # nothing before, no key, or no answer from Redis
            return Admission(first=True)
        before = reply.decode() if isinstance(reply, bytes) else str(reply)
        if before == _ADMITTED_MARK:
            return Admission(first=False)
        return Admission(first=False, rescued_from=before)

    async def _ask(self, script: Any, key: str | None, value: str) -> Any:
        """The script's reply; None without a key, or when Redis failed (or is being left alone
        after failing)."""
        if key is None or self._clock() < self._quiet_until:
            return None
        try:
            return await script(keys=[self._prefix + key], args=[value, self._ttl_ms])
        except Exception as exc:  # any failure of the store: count the try alone
            self._quiet_until = self._clock() + self._pause
            log.warning(
                "fleet attempts: Redis failed (%s: %s); counting tries alone for %.0f s",
                type(exc).__name__,
                exc,
                self._pause,
            )
            return None
