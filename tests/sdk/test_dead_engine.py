"""Nobody to serve the call: a shim whose engine is down, a gateway with no one behind it.

Real servers on 127.0.0.1 and the real openai client. The shim (in process, from
``llm-backoff-shim``; those tests are skipped where it is not installed, as in the openai 2.x
environment) answers 503 ``upstream_unavailable`` while its engine cannot be reached, with
the outage's length so far as the hint. ``wrap(client)``'s default policy counts those
answers with refused connections (``max_connect_errors``, 3) and backs off from them as from
a refused connection, so it gives up after as many attempts as against a dead server; the
batch preset (``max_connect_errors=None``) waits out the hints and rides out an engine that
crashes under the call and comes back. Waits are skipped (``instant_retries``) but still
decided and recorded: the tests assert attempts, statuses and the waits chosen, never time.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

import llm_backoff
from llm_backoff import RetryEvent
from llm_backoff.testing import instant_retries

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
UNAVAILABLE = "status 503 upstream_unavailable"


def closed_port() -> int:
    """A port nothing listens on (bound for a moment, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def chat(client: Any, **options: Any) -> Any:
    return client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4, **options)


@pytest.fixture
def shim() -> Iterator[Callable[..., Any]]:
    """``shim(upstream_url, clock=None)``: a shim on loopback in front of ``upstream_url``, served
    as ``llm-backoff-shim serve`` serves it; ``clock`` drives its outage hints."""
    app_module = pytest.importorskip("llm_backoff_shim.serve.app")
    settings_module = pytest.importorskip("llm_backoff_shim.serve.config.settings")
    serving = pytest.importorskip("llm_backoff_shim.serve.serving")
    servers: list[Any] = []

    def start(upstream: str, clock: Callable[[], float] | None = None) -> Any:
        settings = settings_module.ShimSettings(upstream=upstream, log_level="error")
        options = {} if clock is None else {"clock": clock}
        server = serving.shim_server(app_module.create_app(settings, **options)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_the_default_gives_up_on_a_dead_engine_behind_a_shim_as_on_a_dead_server(
    shim: Callable[..., Any],
) -> None:
    from llm_backoff_shim.testing import ManualClock

    dead = f"http://127.0.0.1:{closed_port()}"
    front = shim(dead, ManualClock(100.0))  # the outage stays 0 s old: every hint is the 1 s floor
    with instant_retries():
        with pytest.raises(openai.InternalServerError) as behind:
            chat(llm_backoff.wrap(openai.OpenAI(base_url=front.url + "/v1", api_key="x")))
        with pytest.raises(openai.APIConnectionError) as direct:
            chat(llm_backoff.wrap(openai.OpenAI(base_url=dead + "/v1", api_key="x")))
    assert behind.value.status_code == 503
    assert isinstance(behind.value.body, dict)
    assert behind.value.body["code"] == "upstream_unavailable"
    history = behind.value.llm_backoff_attempts  # type: ignore[attr-defined]
    assert len(history) == len(direct.value.llm_backoff_attempts) == 3  # type: ignore[attr-defined]
    assert [(a.status, a.reason, a.hint) for a in history] == [(503, UNAVAILABLE, 1.0)] * 3
    # Backed off as from a refused connection (full jitter below 0.5 s, then 1 s), not the hint.
    assert history[0].wait < 0.5
    assert history[1].wait < 1.0
    assert "max_connect_errors (3) reached" in behind.value._llm_backoff_reason  # type: ignore[attr-defined]


def test_a_long_outage_does_not_make_callers_wait_for_its_hint(shim: Callable[..., Any]) -> None:
    from llm_backoff_shim.testing import ManualClock

    clock = ManualClock(100.0)
    front = shim(f"http://127.0.0.1:{closed_port()}", clock)
    url = front.url + "/v1"
    with pytest.raises(openai.InternalServerError):  # the outage begins
        chat(openai.OpenAI(base_url=url, api_key="x", max_retries=0))
    clock.advance(30.0)  # ... and has lasted 30 s: the shim now says "come back in 30 s"

    async def default_async() -> BaseException:
        client = llm_backoff.wrap(openai.AsyncOpenAI(base_url=url, api_key="x"))
        try:
            await client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4)
        except openai.InternalServerError as exc:
            return exc
        raise AssertionError("the call succeeded")

    with instant_retries():
        default = asyncio.run(default_async())
        with pytest.raises(openai.InternalServerError) as interactive:
            chat(llm_backoff.wrap(openai.OpenAI(base_url=url, api_key="x"), request_class="interactive"))
    history = default.llm_backoff_attempts  # type: ignore[attr-defined]
    assert [(a.status, a.hint) for a in history] == [(503, 30.0)] * 3
    assert history[0].wait < 0.5
    assert history[1].wait < 1.0
    # The interactive preset gives up at once on a hint past 40 % of its start deadline, as before.
    only = interactive.value.llm_backoff_attempts  # type: ignore[attr-defined]
    assert [(a.status, a.hint) for a in only] == [(503, 30.0)]
    assert "above max_retry_after" in interactive.value._llm_backoff_reason  # type: ignore[attr-defined]


class CrashingEngine:
    """An engine that takes one request and crashes under it: its listening socket closes and
    the request's connection is reset before any answer (as SIGKILL leaves them)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.got_request = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="crashing-engine")
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        lengths = [
            int(v)
            for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        ]
        length = lengths[0] if lengths else 0
        while len(body) < length:
            body += conn.recv(65536)
        self.got_request.set()
        self.listener.close()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()


def test_the_batch_preset_rides_out_an_engine_that_crashes_under_the_call_and_comes_back(
    shim: Callable[..., Any], serve: Callable[..., str]
) -> None:
    sim = pytest.importorskip("llm_backoff_shim.sim.server")
    engine = CrashingEngine()
    front = shim(f"http://127.0.0.1:{engine.port}")
    events: list[RetryEvent] = []

    def on_retry(event: RetryEvent) -> None:
        events.append(event)
        if len(events) == 2:  # the engine crashed under attempt 1 and refused attempt 2: back now
            serve(sim.create_sim_app(sim.SimConfig(ttft=0.0, itl=0.001, output_tokens=4)), port=engine.port)

    client = llm_backoff.wrap(
        openai.OpenAI(base_url=front.url + "/v1", api_key="x"), request_class="batch", on_retry=on_retry
    )
    with instant_retries():
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", messages=MESSAGES, max_tokens=4
        )
    assert engine.got_request.is_set()
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].message.content
    history = raw.http_response.extensions["llm_backoff.attempts"]
    assert [(a.status, a.reason) for a in history] == [
        (503, UNAVAILABLE),
        (503, UNAVAILABLE),
        (200, "status 200"),
    ]
    # The batch preset waits out the shim's hints (the outage's length so far, at least 1 s).
    assert all(a.wait >= a.hint >= 1.0 for a in history[:2])


def gateway(statuses: list[tuple[int, dict[str, str]]]) -> Starlette:
    """A gateway answering each request with the next (status, headers), an HTML error page."""
    answers = iter(statuses)

    async def completions(request: Request) -> Response:
        status, headers = next(answers)
        return PlainTextResponse("<html>Bad Gateway</html>", status, headers=headers, media_type="text/html")

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


def test_a_gateway_with_no_one_behind_it_counts_as_a_refused_connection(serve: Callable[..., str]) -> None:
    bare = [(502, {}), (504, {}), (502, {}), (200, {})]
    client = llm_backoff.wrap(openai.OpenAI(base_url=serve(gateway(bare)) + "/v1", api_key="x"))
    with instant_retries(), pytest.raises(openai.APIStatusError) as info:
        chat(client)
    history = info.value.llm_backoff_attempts  # type: ignore[attr-defined]
    assert [(a.status, a.reason) for a in history] == [
        (502, "status 502 without a hint"),
        (504, "status 504 without a hint"),
        (502, "status 502 without a hint"),
    ]
    assert "max_connect_errors (3) reached" in info.value._llm_backoff_reason  # type: ignore[attr-defined]


def test_a_gateway_that_gives_a_hint_or_a_busy_answer_restarts_the_count(serve: Callable[..., str]) -> None:
    hinted = {"retry-after": "1"}
    statuses = [(502, {}), (502, {}), (502, hinted), (502, {}), (502, {}), (503, {})] + [(502, {})] * 3
    client = llm_backoff.wrap(openai.OpenAI(base_url=serve(gateway(statuses)) + "/v1", api_key="x"))
    with instant_retries(), pytest.raises(openai.APIStatusError) as info:
        chat(client)
    history = info.value.llm_backoff_attempts  # type: ignore[attr-defined]
    assert [(a.status, a.hint) for a in history] == [(s, 1.0 if h else None) for s, h in statuses]
    assert "max_connect_errors (3) reached" in info.value._llm_backoff_reason  # type: ignore[attr-defined]


def test_the_batch_preset_never_counts_them(serve: Callable[..., str]) -> None:
    url = serve(gateway([(502, {})] * 5)) + "/v1"
    batch = llm_backoff.wrap(openai.OpenAI(base_url=url, api_key="x"), request_class="batch")
    with instant_retries(max_attempts=5), pytest.raises(openai.APIStatusError) as info:
        chat(batch)
    assert len(info.value.llm_backoff_attempts) == 5  # type: ignore[attr-defined]
    assert "max_attempts (5) reached" in info.value._llm_backoff_reason  # type: ignore[attr-defined]
