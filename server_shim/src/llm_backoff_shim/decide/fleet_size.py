"""How many replicas refuse a call together: the fleet a refused caller comes back to.

Behind a load balancer that asks another replica when one refuses (docs/deploy.md, "A fleet"),
a call refused by the whole fleet is refused by every replica, and each places it on its own
timeline of returns (:mod:`llm_backoff_shim.decide.promises`). It comes back once, to one
replica, so each replica should count it as ``1 / replicas`` of a return, and space the
returns it promises at the fleet's drain rate, not its own: counted whole, every replica
spaces refused callers a full service time apart and reserves a slot for each, and under
sustained full-fleet overload the hints grow ``replicas`` times faster than the fleet drains
(measured: docs/deploy.md, "The fleet's Retry-After").

The shim is not told the fleet's size (replicas come and go with an autoscaler); it learns it
from the calls themselves. Replicas that share a call's hints
(:mod:`llm_backoff_shim.serve.policy.fleet_hints`) see how many distinct replicas refused it so
far; the one asked last sees the whole fleet. :class:`FleetSize` keeps the most seen within a
window: every replica is asked last of some calls, so each learns the fleet within a few
refusals, and forgets a replica removed from it a window later. With nothing observed (one
shim, or no shared hints) the fleet is one replica and nothing changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class FleetSize:
    """The most replicas seen refusing one call within the last ``window`` seconds (at least 1)."""

    def __init__(self, clock: Callable[[], float], window: float = 60.0) -> None:
        if window <= 0:
            raise ValueError("window must be positive")
        self._clock = clock
        self._window = window
        # (time, replicas), times ascending and replicas strictly descending: a sighting that
        # an equal or larger later one outlives can never be the maximum again.
        self._seen: deque[tuple[float, int]] = deque()

    def observe(self, replicas: int) -> None:
        """A call was refused by ``replicas`` distinct replicas so far (this one included)."""
        if replicas < 1:
            return
        now = self._clock()
        seen = self._seen
        while seen and seen[-1][1] <= replicas:
            seen.pop()
        seen.append((now, replicas))

    @property
    def replicas(self) -> int:
        seen = self._seen
        horizon = self._clock() - self._window
        while seen and seen[0][0] < horizon:
            seen.popleft()
        return seen[0][1] if seen else 1
