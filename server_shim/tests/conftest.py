"""Shared fixtures for the shim tests: a scriptable fake upstream and shim factories.

The fake upstream is a small Starlette app on loopback whose behaviour each request
picks through headers, so tests stay deterministic without sleeps:

- ``x-fake-hold: 1``      park the request until the test calls ``upstream.release()``;
- ``x-fake-status: 503``  answer with that status (JSON OpenAI-style error body);
- ``x-fake-delay: 0.2``   sleep before answering;
- ``x-fake-chunks: N``    stream N SSE chunks (with ``x-fake-step`` seconds between them,
                          or, with ``x-fake-gated: 1``, each chunk after the first waits
                          for ``upstream.step()``).

It records what it received and counts requests in flight, their peak, completions
and requests whose client (the shim) went away mid-way.

Shims start on the HTTP path ``--shim-http-path`` names (``auto``, ``fast`` or
``public``; default: the environment's ``LLM_BACKOFF_SHIM_HTTP_PATH``, else ``auto``),
exactly as ``llm-backoff-shim serve --http-path`` would: the option sets that variable,
which every ``ShimSettings`` made in the run reads. Tests of the fast path's own
internals carry ``@pytest.mark.fast_path`` and are skipped on the public path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import AnyHttpUrl
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.drain_estimate import DrainEstimator, EstimatorConfig
from llm_backoff_shim.decide.limit import FixedLimit
from llm_backoff_shim.decide.requests import ClassPolicy
from llm_backoff_shim.decide.scheduler import ClassScheduler
from llm_backoff_shim.decide.token_budget import TokenBudget
from llm_backoff_shim.serve.app import ShimRuntime, create_app, shim_state
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.tuning import TUNING, Tuning
from llm_backoff_shim.serve.config.values import env_name
from llm_backoff_shim.serve.serving import ServerThread, shim_server
from llm_backoff_shim.sim.server import SimConfig, create_sim_app
from llm_backoff_shim.testing import ManualClock

_HTTP_PATH_ENV = env_name("http_path")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shim-http-path",
        choices=("auto", "fast", "public"),
        default=None,
        help=f"serving path of every shim the tests start (sets {_HTTP_PATH_ENV}; default: auto)",
    )


def pytest_configure(config: pytest.Config) -> None:
    marker = "fast_path: tests the fast HTTP path's internals (skipped on the public path)"
    config.addinivalue_line("markers", marker)
    chosen = config.getoption("--shim-http-path")
    if chosen is not None:
        os.environ[_HTTP_PATH_ENV] = chosen


def effective_http_path() -> str:
    """The path the shims of this run serve on: ``fast`` or ``public``."""
    requested = os.environ.get(_HTTP_PATH_ENV, "auto")
    if requested != "auto":
        return requested
    from llm_backoff_shim.http.capability import fast_path_problem

    return "fast" if fast_path_problem() is None else "public"


def pytest_report_header(config: pytest.Config) -> str:
    requested = os.environ.get(_HTTP_PATH_ENV, "auto")
    return f"shim HTTP path: {effective_http_path()} ({_HTTP_PATH_ENV}={requested})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if effective_http_path() == "fast":
        return
    skip = pytest.mark.skip(reason="tests the fast HTTP path's internals; this run serves on the public path")
    for item in items:
        if item.get_closest_marker("fast_path") is not None:
            item.add_marker(skip)


@pytest.fixture
def shim_http_path() -> str:
    """``fast`` or ``public``: the path the shims of this run serve on."""
    return effective_http_path()


@dataclass
class Received:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class FakeUpstream:
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0
    completed: int = 0
    client_gone: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _release: threading.Event = field(default_factory=threading.Event)
    _steps: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    url: str = ""

    def release(self) -> None:
        self._release.set()

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self._steps.release()

    def paths(self) -> list[str]:
        with self._lock:
            return [r.path for r in self.received]

    def _enter(self, request: Received) -> None:
        with self._lock:
            self.received.append(request)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def _leave(self, *, completed: bool) -> None:
        with self._lock:
            self.in_flight -= 1
            if completed:
                self.completed += 1
            else:
                self.client_gone += 1

    async def _wait_thread_event(self, wait: Callable[[float], bool], request: Request | None = None) -> None:
        while not wait(0):
            if request is not None and await request.is_disconnected():
                raise _ClientGoneError
            await asyncio.sleep(0.005)

    def build_app(self) -> Starlette:
        async def generation(request: Request) -> Response:
            body = await request.body()
            self._enter(
                Received(
                    request.method,
                    request.url.path,
                    request.url.query,
                    [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                    body,
                )
            )
            headers = request.headers
            chunks = int(headers.get("x-fake-chunks", "0"))
            completed = handed_to_stream = False
            try:
                if headers.get("x-fake-hold"):
                    await self._wait_thread_event(self._release.wait, request)
                await asyncio.sleep(float(headers.get("x-fake-delay", "0")))
                if await request.is_disconnected():
                    # The shim dropped this request while we slept: count it as abandoned,
                    # so tests can tell an abandoned overlap from a broken in-flight cap.
                    raise _ClientGoneError
                status = int(headers.get("x-fake-status", "200"))
                if status != 200:
                    completed = True
                    return JSONResponse(
                        {"error": {"message": f"fake upstream says {status}", "type": "x", "code": None}},
                        status,
                        headers={"x-upstream-marker": "yes"},
                    )
                if chunks > 0:
                    handed_to_stream = True
                    step = float(headers.get("x-fake-step", "0"))
                    return StreamingResponse(
                        self._sse(chunks, step, bool(headers.get("x-fake-gated"))),
                        media_type="text/event-stream",
                        headers={"x-upstream-marker": "yes", "cache-control": "no-cache"},
                    )
                completed = True
                return JSONResponse(
                    {"echo": json.loads(body) if body else None, "path": request.url.path},
                    status_code=int(headers.get("x-fake-ok-status", "200")),
                    headers={"x-upstream-marker": "yes", "set-cookie": "sticky=1; Path=/"},
                )
            except _ClientGoneError:
                return Response(status_code=499)
            finally:
                if not handed_to_stream:
                    self._leave(completed=completed)

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

        async def health(request: Request) -> Response:
            return Response(status_code=200)

        return Starlette(
            routes=[
                Route("/v1/chat/completions", generation, methods=["POST"]),
                Route("/v1/completions", generation, methods=["POST"]),
                Route("/v1/other/{rest:path}", generation, methods=["GET", "POST", "PUT", "DELETE"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
            ]
        )

    async def _sse(self, chunks: int, step: float, gated: bool) -> AsyncIterator[bytes]:
        completed = False
        try:
            for i in range(chunks):
                if i > 0:
                    if gated:
                        await self._wait_thread_event(self._steps.acquire)
                    elif step:
                        await asyncio.sleep(step)
                yield f'data: {{"i": {i}}}\n\n'.encode()
            yield b"data: [DONE]\n\n"
            completed = True
        finally:
            self._leave(completed=completed)


class _ClientGoneError(Exception):
    pass


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    with ServerThread(fake.build_app()) as server:
        fake.url = server.url
        try:
            yield fake
        finally:
            fake.release()
            fake.step(10_000)


@dataclass
class Shim:
    server: ServerThread
    runtime: ShimRuntime

    @property
    def url(self) -> str:
        return self.server.url

    def state(self) -> dict[str, tuple[int, int]]:
        """(in_flight, queued) per class, read on the shim's loop thread."""
        loop = self.server.loop
        assert loop is not None

        async def read() -> dict[str, tuple[int, int]]:
            return {cls: (s.in_flight, s.queued) for cls, s in self.runtime.snapshot().items()}

        return asyncio.run_coroutine_threadsafe(read(), loop).result(5)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Samples of /metrics as {(name, sorted labels): value}, parsed by prometheus_client."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=5).text
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``predicate``; the timeout only bounds a broken test, it asserts no latency."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def make_shim() -> Iterator[Callable[..., Shim]]:
    servers: list[ServerThread] = []

    def factory(
        upstream_url: str,
        *,
        serve_protocol: bool = True,
        tuning: Tuning = TUNING,
        clock: Callable[[], float] = time.monotonic,
        **settings: Any,
    ) -> Shim:
        """A shim on loopback, served as ``serve`` serves it; ``serve_protocol=False``: plain uvicorn;
        ``tuning``: other fixed values (serve/config/tuning.py), to make a scrape or a timeout fast;
        ``clock``: the admission decisions' clock (a ManualClock holds their estimates still)."""
        values: dict[str, Any] = {"upstream": upstream_url, "log_level": "warning"}
        values.update(settings)
        app = create_app(ShimSettings(**values), tuning=tuning, clock=clock)
        server = (shim_server(app) if serve_protocol else ServerThread(app)).start()
        servers.append(server)
        return Shim(server, shim_state(app))

    yield factory
    for server in servers:
        server.stop()


@contextlib.contextmanager
def _sim_and_shim(config: SimConfig) -> Iterator[tuple[ServerThread, ServerThread]]:
    sim = ServerThread(create_sim_app(config))
    shim: ServerThread | None = None
    try:
        sim.start()
        settings = ShimSettings(upstream=AnyHttpUrl(sim.url), log_level="warning", access_log=False)
        shim = shim_server(create_app(settings))
        shim.start()
        yield sim, shim
    finally:
        if shim is not None:
            shim.stop()
        sim.stop()


SimAndShim = Callable[[SimConfig], contextlib.AbstractContextManager[tuple[ServerThread, ServerThread]]]


@pytest.fixture(scope="session")
def sim_and_shim_servers() -> SimAndShim:
    """``with sim_and_shim_servers(SimConfig(...)) as (sim, shim)``: the simulator and a shim with
    the default settings in front of it, in this process, both stopped on leaving."""
    return _sim_and_shim


@pytest.fixture
def waiter() -> Callable[..., None]:
    return wait_until


#: ``read(sock, count)``: ``count`` answers with a length (status, headers, body) off one connection.
ReadAnswers = Callable[[socket.socket, int], list[tuple[int, dict[str, str], bytes]]]


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """``count`` answers with a length, read off one connection; nothing more may follow them."""
    buffer = b""
    answers: list[tuple[int, dict[str, str], bytes]] = []
    while len(answers) < count:
        while b"\r\n\r\n" not in buffer:
            data = sock.recv(65536)
            assert data, f"connection closed after {len(answers)} answers"
            buffer += data
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        length = int(headers["content-length"])
        while len(buffer) < length:
            data = sock.recv(65536)
            assert data, "connection closed inside a body"
            buffer += data
        answers.append((int(status_line.split()[1]), headers, buffer[:length]))
        buffer = buffer[length:]
    assert buffer == b"", "more bytes than the answers expected"
    return answers


@pytest.fixture
def answers() -> ReadAnswers:
    return read_answers


# -- the pure admission controller -------------------------------------------------------------

#: ``make_controller(limit, **options) -> (controller, clock)``; see :func:`build_pure_controller`.
MakeController = Callable[..., tuple[AdmissionController, ManualClock]]


def build_pure_controller(
    limit: int = 2,
    *,
    classes: Sequence[str] = ("interactive", "batch"),
    max_queue: int | None = 100,
    max_wait: float = 60.0,
    max_queues: Mapping[str, int | None] | None = None,
    max_waits: Mapping[str, float] | None = None,
    start: float = 0.0,
    scheduler: ClassScheduler | None = None,
    max_queue_total: int | None = None,
    returning_share: float = 0.25,
    returning_first: bool = True,
    promise_slack: float = 0.1,
    token_budget: int | None = None,
    **estimator: Any,
) -> tuple[AdmissionController, ManualClock]:
    """An :class:`AdmissionController` over ``limit`` fixed slots, driven by a manual clock set at
    ``start``. ``classes`` highest priority first, each with ``max_queue`` places (None: what the
    slots drain within the wait) and ``max_wait`` seconds of queue wait unless ``max_queues`` /
    ``max_waits`` name it; ``estimator``: fields of
    :class:`EstimatorConfig` (its defaults otherwise). The other options are the controller's,
    with its defaults; ``token_budget``: a cost budget in tokens (none by default)."""
    clock = ManualClock(start)
    queues, waits = max_queues or {}, max_waits or {}
    unknown = (set(queues) | set(waits)) - set(classes)
    assert not unknown, f"bounds for classes not built: {unknown}"
    controller = AdmissionController(
        [ClassPolicy(name, queues.get(name, max_queue), waits.get(name, max_wait)) for name in classes],
        limit=FixedLimit(limit),
        estimator=DrainEstimator(EstimatorConfig(**estimator), clock),
        clock=clock,
        scheduler=scheduler,
        max_queue_total=max_queue_total,
        returning_share=returning_share,
        returning_first=returning_first,
        promise_slack=promise_slack,
        token_budget=None if token_budget is None else TokenBudget(token_budget),
    )
    return controller, clock


@pytest.fixture(scope="session")
def make_controller() -> MakeController:
    """:func:`build_pure_controller`: the one way the tests build a pure admission controller. Session
    scope: it holds no state, and hypothesis tests may use it (no per-example fixture reset)."""
    return build_pure_controller
