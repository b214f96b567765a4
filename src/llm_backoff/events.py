"""What a retry looks like from outside: the event passed to ``on_retry`` hooks.

`RetryObservers` is the subscriber list a transport emits to. It is safe to
subscribe, unsubscribe and emit from many threads and tasks at once: emitting
iterates over an immutable snapshot, so a hook added mid-call sees only later
events. A hook that raises is logged (with traceback) and does not break the call
it observes: a broken metrics hook should not turn a recoverable 429 into an outage.
Hooks are plain callables, called synchronously in the thread or task that retries.

`CallObserver` / `CallObservers` are the wider channel the stats object
(`stats.ClientStats`) and the OpenTelemetry bridge (`otel`) listen on: besides each
retry, limiter waits, retry-budget refusals and the end of every call. Each
transport engine owns its own `CallObservers` (a `RetryObservers` may be shared by
several clients; per-client counters must not be).
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


class CallObserver:
    """Sees what a wrapped client's transport does, call by call (stats, OpenTelemetry).

    Subclass and override what you need; every method is a no-op here. Methods are
    called synchronously in the thread or task making the call, so keep them cheap.
    As with ``on_retry`` hooks, an exception is logged and the call goes on.
    """

    def limiter_waited(self, seconds: float, *, granted: bool) -> None:
        """The limiter answered after ``seconds``: a permit (``granted``) or `RateLimitTimeout`."""

    def retrying(self, event: RetryEvent) -> None:
        """A retry is about to wait ``event.wait`` seconds (the same event ``on_retry`` gets)."""

    def budget_refused(self) -> None:
        """The retry budget refused a retry; the call gives up."""

    def call_ended(self, outcome: str, attempts: int) -> None:
        """One logical call is over: ``outcome`` is one of `CALL_OUTCOMES`.

        ``attempts`` counts the attempts that reached an outcome (a response or an
        error), so a call refused by the limiter before its first send has 0.
        """


#: ``ok``: a response below 400; ``failed``: an error response or exception after any
#: retries; ``cancelled``: the caller's task was cancelled or interrupted mid-call.
CALL_OUTCOMES = ("ok", "failed", "cancelled")


class CallObservers:
    """The `CallObserver` list of one transport engine; same snapshot rules as `RetryObservers`."""

    def __init__(self, observers: Iterable[CallObserver] = ()) -> None:
        self._lock = threading.Lock()
        self.observers: tuple[CallObserver, ...] = tuple(observers)

    def subscribe(self, observer: CallObserver) -> Callable[[], None]:
        """Add ``observer``; returns a function that removes it again."""
        with self._lock:
            self.observers = (*self.observers, observer)

        def unsubscribe() -> None:
            with self._lock:
                self.observers = tuple(o for o in self.observers if o is not observer)

        return unsubscribe

    def __len__(self) -> int:
        return len(self.observers)

    def limiter_waited(self, seconds: float, *, granted: bool) -> None:
        for observer in self.observers:
            try:
                observer.limiter_waited(seconds, granted=granted)
            except Exception:
                logger.exception("llm_backoff: observer %r raised; the call goes on", observer)

    def retrying(self, event: RetryEvent) -> None:
        for observer in self.observers:
            try:
                observer.retrying(event)
            except Exception:
                logger.exception("llm_backoff: observer %r raised; the call goes on", observer)

    def budget_refused(self) -> None:
        for observer in self.observers:
            try:
                observer.budget_refused()
            except Exception:
                logger.exception("llm_backoff: observer %r raised; the call goes on", observer)

    def call_ended(self, outcome: str, attempts: int) -> None:
        for observer in self.observers:
            try:
                observer.call_ended(outcome, attempts)
            except Exception:
                logger.exception("llm_backoff: observer %r raised; the call goes on", observer)
