"""The per-attempt hard deadline of the async transports (asyncio fast path and anyio).

On asyncio (Python >= 3.11) the bound is `llm_backoff._attempt_bound.AttemptBound` (one
timer per event loop, the semantics of ``asyncio.timeout``); elsewhere an anyio cancel
scope. Either way only the expiry of our own bound becomes the HTTP library's ReadTimeout;
a TimeoutError raised inside the attempt is the attempt's own failure, left as it is.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import pytest

from llm_backoff import RetryPolicy


def _async_transport(lib: ModuleType) -> Any:
    if lib.__name__ == "httpx2":
        from llm_backoff._httpx2_transport import AsyncHttpx2RetryTransport

        return AsyncHttpx2RetryTransport
    from llm_backoff._httpx_transport import AsyncHttpxRetryTransport

    return AsyncHttpxRetryTransport


def _client(lib: ModuleType, handler: Any, policy: RetryPolicy) -> Any:
    transport = _async_transport(lib)(lib.MockTransport(handler), policy)
    return lib.AsyncClient(transport=transport, base_url="http://api")


async def test_an_attempt_that_never_answers_ends_at_the_deadline_as_read_timeout(lib: ModuleType) -> None:
    stalled = asyncio.Event()

    async def handler(request: Any) -> Any:
        stalled.set()
        await asyncio.Event().wait()  # never answers; only the deadline can end this

    async with _client(lib, handler, RetryPolicy(deadline=0.05, max_attempts=1)) as client:
        with pytest.raises(lib.ReadTimeout, match="deadline passed") as info:
            await client.get("/x")
    assert stalled.is_set()
    assert len(info.value.llm_backoff_attempts) == 1


async def test_a_timeout_error_from_inside_the_attempt_is_not_taken_for_the_deadline(lib: ModuleType) -> None:
    async def handler(request: Any) -> Any:
        raise TimeoutError("raised by the inner transport")

    async with _client(lib, handler, RetryPolicy(deadline=30, max_attempts=1)) as client:
        with pytest.raises(TimeoutError, match="raised by the inner transport") as info:
            await client.get("/x")
    assert not isinstance(info.value, lib.ReadTimeout)
    assert len(info.value.llm_backoff_attempts) == 1  # type: ignore[attr-defined]


async def test_a_buffered_json_answer_is_readable_after_the_bound(lib: ModuleType) -> None:
    async def handler(request: Any) -> Any:
        return lib.Response(200, headers={"content-type": "application/json"}, content=b'{"ok": true}')

    for deadline in (30.0, None):
        async with _client(lib, handler, RetryPolicy(deadline=deadline)) as client:
            response = await client.post("/x", content=b"{}")
        assert response.json() == {"ok": True}
        assert len(response.extensions["llm_backoff.attempts"]) == 1


async def test_a_failed_attempt_leaves_no_timer_behind(lib: ModuleType) -> None:
    calls = 0

    async def handler(request: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise lib.ConnectError("refused", request=request)
        return lib.Response(200, json={"ok": True})

    async with _client(lib, handler, RetryPolicy(deadline=0.3, base_delay=0.001, max_delay=0.001)) as client:
        response = await client.get("/x")
    assert response.status_code == 200
    # A bound left armed by the failed attempt would cancel this task here.
    await asyncio.sleep(0.45)
    assert calls == 2


async def test_one_stalled_attempt_among_many_ends_alone_at_its_deadline(lib: ModuleType) -> None:
    release = asyncio.Event()

    async def handler(request: Any) -> Any:
        if request.url.path == "/stall":
            await asyncio.Event().wait()
        await release.wait()
        return lib.Response(200, json={"ok": True})

    async with (
        _client(lib, handler, RetryPolicy(deadline=30, max_attempts=1)) as slow_deadline,
        _client(lib, handler, RetryPolicy(deadline=0.05, max_attempts=1)) as short_deadline,
    ):
        # the long deadlines join first: the short one must re-arm the shared timer earlier
        others = [asyncio.create_task(slow_deadline.get("/ok")) for _ in range(5)]
        await asyncio.sleep(0)
        with pytest.raises(lib.ReadTimeout, match="deadline passed"):
            await short_deadline.get("/stall")
        assert not any(task.done() for task in others)
        release.set()
        responses = await asyncio.gather(*others)
    assert [r.status_code for r in responses] == [200] * 5


async def test_a_cancellation_from_outside_is_not_taken_for_the_deadline(lib: ModuleType) -> None:
    started = asyncio.Event()

    async def handler(request: Any) -> Any:
        started.set()
        await asyncio.Event().wait()

    async with _client(lib, handler, RetryPolicy(deadline=0.5, max_attempts=1)) as client:
        task = asyncio.create_task(client.get("/x"))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the deadline passing later must not disturb anything else on the loop
        await asyncio.sleep(0.65)


async def test_a_loop_that_takes_no_attributes_gets_a_timer_per_attempt() -> None:
    from llm_backoff._attempt_bound import AttemptBound

    class SlottedLoopTask:
        """What AttemptBound needs of a task, on a loop object without a __dict__."""

        def __init__(self, loop: Any) -> None:
            self.loop = loop
            self.cancelled = 0

        def get_loop(self) -> Any:
            return self.loop

        def cancelling(self) -> int:
            return 0

        def cancel(self) -> None:
            self.cancelled += 1

        def uncancel(self) -> int:
            self.cancelled -= 1
            return self.cancelled

    class Slotted:
        __slots__ = ("inner",)

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def call_at(self, when: float, callback: Any, *, context: Any) -> Any:
            return self.inner.call_at(when, callback, context=context)

    loop = asyncio.get_running_loop()
    task = SlottedLoopTask(Slotted(loop))
    bound = AttemptBound(task, loop.time() + 0.01)
    await asyncio.sleep(0.05)
    assert task.cancelled == 1
    assert bound.expired()
    quiet = AttemptBound(task, loop.time() + 0.01)
    assert not quiet.expired()
    await asyncio.sleep(0.05)
    assert task.cancelled == 0
