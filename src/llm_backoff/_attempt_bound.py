"""The hard deadline of one async attempt on asyncio, with one timer per event loop.

Per-operation timeouts (connect, read, write, pool) alone let a response that trickles
in stretch a call past its deadline, so every async attempt runs under a hard bound.
``asyncio.timeout`` does that with a timer per attempt: a ``TimerHandle``, a push onto
the loop's heap (its comparisons are Python calls), a cancellation, and async
``__aenter__``/``__aexit__`` around it, about 5.5 us per call, a large share of what the
async wrapper adds to a call. Deadlines
are long next to attempts (a minute against a second), so nearly all of those timers are
cancelled unfired.

Here an attempt joins its loop's `_Watchdog` (a dict entry) and leaves it when it ends;
the watchdog keeps one timer, armed for the earliest deadline that joined since it
last fired. When it fires it cancels the attempts that are due and re-arms for the
earliest one left, so with a steady stream of calls it fires about once per deadline.
A loop that takes no attributes (the watchdog lives on the loop, so it goes when the
loop goes) gets a timer per attempt instead.

The semantics are those of ``asyncio.timeout`` (Python 3.11+, ``Task.uncancel``): at
expiry the task is cancelled; when the attempt ends, `AttemptBound.expired` uncancels
it and says whether the cancellation was the bound's alone, so a cancellation from
outside is never swallowed. An attempt that finished just as its bound fired keeps its
answer, as under ``asyncio.timeout``.
"""

from __future__ import annotations

import contextvars
import math
from typing import Any

__all__ = ["AttemptBound"]

_ATTRIBUTE = "_llm_backoff_watchdog"
#: Timer callbacks here only cancel tasks: they need no context variables, so no copy.
_TIMER_CONTEXT = contextvars.Context()


class AttemptBound:
    """Cancel ``task`` at loop time ``when`` unless `expired` is called first."""

    __slots__ = ("_cancelling", "_fired", "_handle", "_task", "_watchdog", "when")

    def __init__(self, task: Any, when: float) -> None:
        self.when = when
        self._task = task
        self._cancelling: int = task.cancelling()
        self._fired = False
        loop = task.get_loop()
        watchdog: _Watchdog | None = getattr(loop, _ATTRIBUTE, None)
        if watchdog is None:
            watchdog = _Watchdog.install(loop)
        self._watchdog = watchdog
        if watchdog is not None:
            self._handle: Any = None
            watchdog.add(self)
        else:
            self._handle = loop.call_at(when, self.fire, context=_TIMER_CONTEXT)

    def fire(self) -> None:
        self._fired = True
        self._task.cancel()

    def expired(self) -> bool:
        """Disarm (call it however the attempt ended); True when the bound alone cancelled it."""
        if self._watchdog is not None:
            self._watchdog.discard(self)
        else:
            self._handle.cancel()
        return self._fired and self._task.uncancel() <= self._cancelling


class _Watchdog:
    """The bounds of the attempts in flight on one event loop, and its one timer."""

    __slots__ = ("_armed_at", "_bounds", "_handle", "_loop")

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._bounds: dict[AttemptBound, None] = {}
        self._handle: Any = None
        self._armed_at = math.inf

    @classmethod
    def install(cls, loop: Any) -> _Watchdog | None:
        watchdog = cls(loop)
        try:
            setattr(loop, _ATTRIBUTE, watchdog)
        except (AttributeError, TypeError):  # e.g. a loop class with __slots__
            return None
        return watchdog

    def add(self, bound: AttemptBound) -> None:
        self._bounds[bound] = None
        if bound.when < self._armed_at:
            self._arm(bound.when)

    def discard(self, bound: AttemptBound) -> None:
        # The timer stays armed: re-arming on every exit would cost what this saves.
        self._bounds.pop(bound, None)

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = when
        self._handle = self._loop.call_at(when, self._fire, context=_TIMER_CONTEXT)

    def _fire(self) -> None:
        self._handle = None
        self._armed_at = math.inf
        now = self._loop.time()
        due = [bound for bound in self._bounds if bound.when <= now]
        for bound in due:
            del self._bounds[bound]
            bound.fire()
        if self._bounds:
            self._arm(min(bound.when for bound in self._bounds))
