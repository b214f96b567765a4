from __future__ import annotations

import logging
import threading

import pytest

from llm_backoff import RetryEvent, RetryObservers

EVENT = RetryEvent(
    attempt=1, reason="status 429", wait=1.0, hint=1.0, elapsed=0.1, method="GET", url="http://x"
)


def test_subscribe_emit_unsubscribe() -> None:
    seen: list[RetryEvent] = []
    observers = RetryObservers()
    unsubscribe = observers.subscribe(seen.append)
    observers.emit(EVENT)
    unsubscribe()
    unsubscribe()  # idempotent
    observers.emit(EVENT)
    assert seen == [EVENT]
    assert len(observers) == 0


def test_a_failing_hook_is_logged_and_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[RetryEvent] = []

    def broken(_: RetryEvent) -> None:
        raise RuntimeError("boom")

    observers = RetryObservers([broken, seen.append])
    with caplog.at_level(logging.ERROR, logger="llm_backoff"):
        observers.emit(EVENT)
    assert seen == [EVENT]
    assert "boom" in caplog.text


def test_concurrent_subscribe_and_emit() -> None:
    observers = RetryObservers()
    counts: list[int] = []
    lock = threading.Lock()

    def hook(_: RetryEvent) -> None:
        with lock:
            counts.append(1)

    def worker() -> None:
        for _ in range(200):
            remove = observers.subscribe(hook)
            observers.emit(EVENT)
            remove()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(observers) == 0
    # each emit saw at least its own subscription
    assert len(counts) >= 8 * 200
