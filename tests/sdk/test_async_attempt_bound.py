"""The per-attempt hard deadline of the async transports (asyncio fast path and anyio).

On asyncio (Python >= 3.11) the bound is ``asyncio.timeout``; elsewhere an anyio cancel
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
