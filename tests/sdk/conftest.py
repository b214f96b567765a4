"""Shared fixtures for the SDK tests.

- ``fake_time``: a monotonic clock plus sleep functions that advance it instead of
  sleeping, so retry timing is asserted exactly and no test waits.
- ``lib``: the HTTP library under test, ``httpx`` and ``httpx2``; the httpx2 case
  is skipped where httpx2 is not installed (the openai 2.x environment).
- ``serve``: runs a small ASGI app under uvicorn on a free 127.0.0.1 port in a
  background thread for end-to-end tests (the shim's ServerThread is not installed
  in the openai 2.x environment, so this is a self-contained copy of the idea).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import uvicorn


class FakeTime:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)

    def engine_options(self, seed: int = 1) -> dict[str, Any]:
        import random

        return {
            "clock": self.clock,
            "sleep": self.sleep,
            "async_sleep": self.async_sleep,
            "rng": random.Random(seed),
        }


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


@pytest.fixture(params=["httpx", "httpx2"])
def lib(request: pytest.FixtureRequest) -> ModuleType:
    return pytest.importorskip(request.param)


class _Server:
    """``app`` under uvicorn on 127.0.0.1, on ``port`` (0: a free one) so a test can bring a
    server back where another one was."""

    def __init__(self, app: Any, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"uvicorn:{self.port}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        with contextlib.suppress(BaseException):
            asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("loopback server did not start")
            time.sleep(0.005)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """``url = serve(app, port=0)``: the app runs until the test ends (on ``port``, if given)."""
    servers: list[_Server] = []

    def start(app: Any, port: int = 0) -> str:
        server = _Server(app, port)
        server.start()
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.stop()


class _BrokenBody:
    """A response body that yields ``chunks`` and then fails with ``error`` (a connection lost mid-body)."""

    def __init__(self, chunks: list[bytes], error: Exception) -> None:
        self.chunks = chunks
        self.error = error
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        raise self.error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        raise self.error

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def _broken_stream(lib: ModuleType, chunks: list[bytes], error: Exception | None = None) -> Any:
    class Stream(_BrokenBody, lib.SyncByteStream, lib.AsyncByteStream):  # type: ignore[misc]
        pass

    return Stream(chunks, error if error is not None else lib.ReadError("connection reset mid-body"))


@pytest.fixture
def broken_stream() -> Callable[..., Any]:
    """``broken_stream(lib, chunks, error=None)``: a sync and async body that breaks after ``chunks``
    (``lib.ReadError("connection reset mid-body")`` unless another error is given)."""
    return _broken_stream
