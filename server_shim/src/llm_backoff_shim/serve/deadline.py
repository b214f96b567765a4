"""``move_on_after`` for the request path: a time limit on a block of asyncio code, cheaply.

``with MoveOnAfter(5.0) as limit: ...`` cancels the current task if the block is still
running after 5 s, absorbs that cancellation at the end of the block and sets
``limit.expired``; a cancellation from anywhere else passes through. ``None`` means
no limit. Given a :class:`~llm_backoff_shim.http.coarse_timers.CoarseTimers` instead of seconds,
the limit is that instance's delay, kept on its shared timer (cheaper still, less precise).

Why not ``anyio.move_on_after``: the shim runs one per request, and on the benchmark
machines anyio's cancel scope (backend lookup, task-state bookkeeping, level-triggered
re-cancellation) cost about 5 times an ``asyncio`` timer handle (bench/bench_proxy.py).
Why not ``asyncio.timeout``: Python 3.11+ only, and the shim supports 3.10.
"""

from __future__ import annotations

import asyncio
import sys
from types import TracebackType
from typing import Any

from llm_backoff_shim.http.coarse_timers import CoarseTimers


class MoveOnAfter:
    """A one-shot time limit on the ``with`` block, in the current asyncio task."""

    __slots__ = ("_delay", "_handle", "_key", "_task", "expired")

    def __init__(self, delay: float | CoarseTimers | None, task: asyncio.Task[Any] | None = None) -> None:
        self._delay = delay
        self._handle: asyncio.TimerHandle | None = None
        self._key: int | None = None
        # The caller may know its task already: finding it costs a getpid() syscall on
        # Python 3.11 (asyncio's fork check), a few microseconds per request here.
        self._task: asyncio.Task[Any] | None = task
        self.expired = False

    def __enter__(self) -> MoveOnAfter:
        if self._delay is not None:
            task = self._task or asyncio.current_task()
            if task is None:
                raise RuntimeError("MoveOnAfter needs a running asyncio task")
            self._task = task
            if isinstance(self._delay, CoarseTimers):
                self._key = self._delay.add(self._expire, task.get_loop())
            else:
                self._handle = task.get_loop().call_later(self._delay, self._expire)
        return self

    def _expire(self) -> None:
        self.expired = True
        assert self._task is not None
        self._task.cancel()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self._handle is not None:
            self._handle.cancel()
        elif self._key is not None:
            assert isinstance(self._delay, CoarseTimers)
            self._delay.discard(self._key)
        if not self.expired or self._task is None:
            return False
        # Ours fired: absorb its cancellation unless another one is pending too.
        return exc_type is asyncio.CancelledError and not _other_cancel_pending(self._task)


def _other_cancel_pending(task: asyncio.Task[Any]) -> bool:
    if sys.version_info >= (3, 11):
        return task.uncancel() > 0
    return False  # 3.10 cannot tell; a shutdown cancel in the same instant is absorbed
