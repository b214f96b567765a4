"""Many timeouts of one length on one event-loop timer, checked a few times per period.

Why: the shim starts a timeout for every request (the request head's, the body's) and
almost always cancels it a millisecond later. One event-loop timer per request, armed
and cancelled, cost about 15 us of CPU per request each on the benchmark machines
(py-spy on bench/bench_proxy.py: uvloop's ``TimerHandle``, and the loop re-arming its
own timer). Here starting a timeout is a dict insertion and cancelling it a deletion;
one loop timer ticks while any timeout is pending. The price is precision: a timeout
fires up to ``resolution`` late (a quarter of the delay, at most one second), which is
fine for limits of seconds meant to cut off clients that stall.

All timeouts of one instance have the same delay, so insertion order is deadline
order and a tick only looks at the ones that are due.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable


class CoarseTimers:
    """``add(callback)`` runs ``callback`` about ``delay`` seconds later unless ``discard``-ed."""

    def __init__(self, delay: float) -> None:
        if not delay > 0:
            raise ValueError("delay must be > 0")
        self.delay = delay
        self.resolution = min(1.0, delay / 4)
        self._pending: dict[int, tuple[float, Callable[[], None]]] = {}
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick_handle: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, callback: Callable[[], None], loop: asyncio.AbstractEventLoop | None = None) -> int:
        """Schedule ``callback``; returns the key for :meth:`discard`. Needs a running loop."""
        if loop is None:
            loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # A new loop (tests run several); timeouts left on a closed loop can never fire.
            self._loop, self._tick_handle = loop, None
            self._pending.clear()
        key = next(self._keys)
        self._pending[key] = (loop.time() + self.delay, callback)
        if self._tick_handle is None:
            self._tick_handle = loop.call_later(self.resolution, self._tick)
        return key

    def discard(self, key: int | None) -> None:
        if key is not None:
            self._pending.pop(key, None)

    def _tick(self) -> None:
        self._tick_handle = None
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        due: list[Callable[[], None]] = []
        for deadline, callback in self._pending.values():
            if deadline > now:
                break
            due.append(callback)
        for _ in due:
            self._pending.pop(next(iter(self._pending)))
        if self._pending:
            self._tick_handle = loop.call_later(self.resolution, self._tick)
        for callback in due:
            callback()
