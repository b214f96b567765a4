"""The retrying transports for httpx2 (openai 3.x).

Thin shells over `llm_backoff.engine.RetryEngine`; see that module for what an
attempt does. This module imports ``httpx2`` and is only imported when a httpx2
client is wrapped or one of these classes is asked for.

``owns_inner`` decides whether closing the retry transport closes the wrapped one:
True when you build ``httpx2.Client(transport=Httpx2RetryTransport(httpx2.HTTPTransport()))``
yourself; False when `llm_backoff.wrap` shares the caller's connection pool, which
must stay open for the client it was given.

This module and its twin for the other library are deliberately line-for-line alike:
each class must subclass its own library's base classes (openai and httpx check
them), and two small, statically typed modules read better than a class factory
that mypy cannot follow. Change both together.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2

from .bodies import Flavor, StreamGuard
from .engine import RetryEngine
from .policy import RetryPolicy
from .stream_start import aclose_iterated, close_iterated


class _GuardedStream(httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, guard: StreamGuard) -> None:
        self._inner = inner
        self._guard = guard

    def __iter__(self) -> Iterator[bytes]:
        recorder = self._guard.recorder
        try:
            if recorder is None:
                yield from self._inner
            else:
                for chunk in self._inner:
                    recorder.feed(chunk)
                    yield chunk
        except Exception as exc:
            self._guard.broke(exc)
            raise

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._guard.closed()


class _AsyncGuardedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, guard: StreamGuard) -> None:
        self._inner = inner
        self._guard = guard

    async def __aiter__(self) -> AsyncIterator[bytes]:
        recorder = self._guard.recorder
        try:
            async for chunk in self._inner:
                if recorder is not None:
                    recorder.feed(chunk)
                yield chunk
        except Exception as exc:
            self._guard.broke(exc)
            raise

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._guard.closed()


class _ReplayedStream(httpx2.SyncByteStream):
    """The bytes read before the first content (`stream_start`), then the rest of the stream."""

    def __init__(self, head: bytes, rest: Iterator[bytes], inner: httpx2.SyncByteStream) -> None:
        self._head = head
        self._rest = rest
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        yield self._head
        yield from self._rest

    def close(self) -> None:
        close_iterated(self._rest, self._inner)


class _AsyncReplayedStream(httpx2.AsyncByteStream):
    def __init__(self, head: bytes, rest: AsyncIterator[bytes], inner: httpx2.AsyncByteStream) -> None:
        self._head = head
        self._rest = rest
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self._head
        async for chunk in self._rest:
            yield chunk

    async def aclose(self) -> None:
        await aclose_iterated(self._rest, self._inner)


SYNC_FLAVOR = Flavor(
    byte_stream=httpx2.ByteStream, guarded_stream=_GuardedStream, replayed_stream=_ReplayedStream
)
ASYNC_FLAVOR = Flavor(
    byte_stream=httpx2.ByteStream, guarded_stream=_AsyncGuardedStream, replayed_stream=_AsyncReplayedStream
)


class Httpx2RetryTransport(httpx2.BaseTransport):
    """A sync httpx2 transport that retries through ``inner`` under a `RetryPolicy`."""

    def __init__(
        self,
        inner: httpx2.BaseTransport,
        policy: RetryPolicy | None = None,
        *,
        engine: RetryEngine | None = None,
        owns_inner: bool = True,
        **engine_options: Any,
    ) -> None:
        if engine is not None and (policy is not None or engine_options):
            raise TypeError("pass either engine= or policy/engine options, not both")
        self.inner = inner
        self.engine = engine if engine is not None else RetryEngine(policy, **engine_options)
        self.owns_inner = owns_inner

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response: httpx2.Response = self.engine.run_sync(request, self.inner.handle_request, SYNC_FLAVOR)
        return response

    def close(self) -> None:
        if self.owns_inner:
            self.inner.close()


class AsyncHttpx2RetryTransport(httpx2.AsyncBaseTransport):
    """An async httpx2 transport that retries through ``inner`` under a `RetryPolicy`."""

    def __init__(
        self,
        inner: httpx2.AsyncBaseTransport,
        policy: RetryPolicy | None = None,
        *,
        engine: RetryEngine | None = None,
        owns_inner: bool = True,
        **engine_options: Any,
    ) -> None:
        if engine is not None and (policy is not None or engine_options):
            raise TypeError("pass either engine= or policy/engine options, not both")
        self.inner = inner
        self.engine = engine if engine is not None else RetryEngine(policy, **engine_options)
        self.owns_inner = owns_inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response: httpx2.Response = await self.engine.run_async(
            request, self.inner.handle_async_request, ASYNC_FLAVOR
        )
        return response

    async def aclose(self) -> None:
        if self.owns_inner:
            await self.inner.aclose()
