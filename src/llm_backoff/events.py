"""What a retry looks like from outside: the event passed to ``on_retry`` hooks.

`RetryObservers` is the subscriber list a transport emits to. It is safe to
subscribe, unsubscribe and emit from many threads and tasks at once: emitting
iterates over an immutable snapshot, so a hook added mid-call sees only later
events. A hook that raises is logged (with traceback) and does not break the call
it observes: a broken metrics hook should not turn a recoverable 429 into an outage.
Hooks are plain callables, called synchronously in the thread or task that retries.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger("llm_backoff")


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """One retry about to happen: attempt ``attempt`` failed and we wait ``wait`` seconds."""

    attempt: int
    """The attempt that just failed, 1-based."""
    reason: str
    """Why it is retried, e.g. ``"status 429"`` or ``"timeout (ReadTimeout)"``."""
    wait: float
    """Seconds we are about to wait."""
    hint: float | None
    """The server's hint in seconds, if it gave one."""
    elapsed: float
    """Seconds since the call began, waits included."""
    method: str
    url: str


RetryHook = Callable[[RetryEvent], object]


class RetryObservers:
    """A thread-safe list of hooks that receive every `RetryEvent`."""

    def __init__(self, hooks: Iterable[RetryHook] = ()) -> None:
        self._lock = threading.Lock()
        self._hooks: tuple[RetryHook, ...] = tuple(hooks)

    def subscribe(self, hook: RetryHook) -> Callable[[], None]:
        """Add ``hook``; returns a function that removes it again."""
        with self._lock:
            self._hooks = (*self._hooks, hook)

        def unsubscribe() -> None:
            with self._lock:
                hooks = list(self._hooks)
                if hook in hooks:
                    hooks.remove(hook)
                self._hooks = tuple(hooks)

        return unsubscribe

    def __len__(self) -> int:
        return len(self._hooks)

    def emit(self, event: RetryEvent) -> None:
        for hook in self._hooks:  # the tuple is a snapshot: no lock while calling out
            try:
                hook(event)
            except Exception:
                logger.exception("llm_backoff: on_retry hook %r raised; the call goes on", hook)
