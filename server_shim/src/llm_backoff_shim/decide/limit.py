"""How many generation requests may be in flight upstream at once.

The admission controller asks a :class:`ConcurrencyLimit` instead of holding a number,
so an adaptive limit (Envoy's gradient controller, Netflix's AIMD/Vegas) can replace
the fixed one later without touching the controller: it reads ``limit`` before each
admission and reports every finished request through ``on_complete``.
"""

from __future__ import annotations

from typing import Protocol


class ConcurrencyLimit(Protocol):
    @property
    def limit(self) -> int:
        """Current cap on requests in flight (>= 1)."""
        ...

    def on_complete(self, *, service_time: float, in_flight: int, overloaded: bool) -> None:
        """A request held a slot for ``service_time`` s; ``overloaded``: the upstream said so (503)."""
        ...


class FixedLimit:
    """``--max-concurrency``: a cap that never moves."""

    __slots__ = ("_limit",)

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"concurrency limit must be >= 1, got {limit}")
        self._limit = limit

    @property
    def limit(self) -> int:
        return self._limit

    def on_complete(self, *, service_time: float, in_flight: int, overloaded: bool) -> None:
        return None
