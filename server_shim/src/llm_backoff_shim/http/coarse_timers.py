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

:class:`MoveOnAfter` is the same timeout as a time limit on a block of asyncio code:
``with MoveOnAfter(timers) as limit: ...`` cancels the current task if the block is
still running after ``timers.delay``, absorbs that cancellation at the end of the block
and sets ``limit.expired``; a cancellation from anywhere else passes through. Why not
``anyio.move_on_after``: the shim runs one per request, and anyio's cancel scope
(backend lookup, task-state bookkeeping, level-triggered re-cancellation) cost about 5
times an ``asyncio`` timer handle (bench/bench_proxy.py). Why not ``asyncio.timeout``:
Python 3.11+ only, and the shim supports 3.10.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any


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


class MoveOnAfter:
    """A one-shot time limit on the ``with`` block, in the current asyncio task, kept on
    ``timers`` (their delay; None: no limit)."""

    __slots__ = ("_key", "_task", "_timers", "expired")

    def __init__(self, timers: CoarseTimers | None, task: asyncio.Task[Any] | None = None) -> None:
        self._timers = timers
        self._key: int | None = None
        # The caller may know its task already: finding it costs a getpid() syscall on
        # Python 3.11 (asyncio's fork check), a few microseconds per request here.
        self._task: asyncio.Task[Any] | None = task
        self.expired = False

    def __enter__(self) -> MoveOnAfter:
        if self._timers is not None:
            task = self._task or asyncio.current_task()
            if task is None:
                raise RuntimeError("MoveOnAfter needs a running asyncio task")
            self._task = task
            self._key = self._timers.add(self._expire, task.get_loop())
        return self

    def _expire(self) -> None:
        self.expired = True
        assert self._task is not None
        self._task.cancel()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self._key is not None:
            assert self._timers is not None
            self._timers.discard(self._key)
        if not self.expired or self._task is None:
            return False
        # Ours fired: absorb its cancellation unless another one is pending too.
        return exc_type is asyncio.CancelledError and not _other_cancel_pending(self._task)


def _other_cancel_pending(task: asyncio.Task[Any]) -> bool:
    if sys.version_info >= (3, 11):
        return task.uncancel() > 0
    return False  # 3.10 cannot tell; a shutdown cancel in the same instant is absorbed
