"""The shim talks only to its configured upstream, lets in only key holders, and tells no secrets.

Real servers on loopback: the configured fake upstream, a second "elsewhere" server
that no request may ever reach, and the shim with its connection guard. Raw sockets
send request targets that HTTP client libraries would refuse to produce.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llm_backoff_shim.lab.procs import free_port
from llm_backoff_shim.serve.api.auth import (
    ApiKeys,
    KeysFileError,
    bearer_token,
    key_id,
    read_keys_file,
)
from llm_backoff_shim.serve.app import ShimRuntime, create_app, shim_state
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.serve.config.tuning import Tuning
from llm_backoff_shim.serve.config.values import ConfigError
from llm_backoff_shim.serve.serving import ServerThread, free_socket, shim_server

CHAT = "/v1/chat/completions"
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
http = httpx.Client(timeout=10)


@dataclass
class Running:
    server: ServerThread
    runtime: ShimRuntime

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture
def shim_with(upstream: Any) -> Iterator[Callable[..., Running]]:
    servers: list[ServerThread] = []

    def factory(server_options: dict[str, Any] | None = None, **settings: Any) -> Running:
        values: dict[str, Any] = {"upstream": upstream.url, "log_level": "warning"}
        values.update(settings)
        app = create_app(ShimSettings(**values))
        server = shim_server(app, **(server_options or {})).start()
        servers.append(server)
        return Running(server, shim_state(app))

    yield factory
    for server in servers:
        server.stop()


@dataclass
class Elsewhere:
    url: str
    received: list[str]


@pytest.fixture
def elsewhere() -> Iterator[Elsewhere]:
    """A second server: the place a forged target would try to reach. It records every request."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    seen: list[str] = []

    async def anything(request: Request) -> PlainTextResponse:
        seen.append(request.url.path)
        return PlainTextResponse("elsewhere")

    app = Starlette(routes=[Route("/{p:path}", anything, methods=["GET", "POST", "PUT", "DELETE"])])
    with ServerThread(app) as server:
        yield Elsewhere(server.url, seen)


def raw(shim: Running, head: bytes) -> tuple[int, bytes]:
    with socket.create_connection((shim.server.host, shim.server.port), timeout=10) as sock:
        sock.sendall(head)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


# -- only the configured upstream, only under /v1/ -----------------------------------------


def test_absolute_form_target_goes_to_the_configured_upstream_only(
    shim_with: Callable[..., Running], upstream: Any, elsewhere: Any
) -> None:
    shim = shim_with()
    other = elsewhere.url.removeprefix("http://")
    status, _ = raw(
        shim,
        f"GET http://{other}/v1/models HTTP/1.1\r\nHost: {other}\r\nConnection: close\r\n\r\n".encode(),
    )
    assert status in (200, 400, 404)
    assert elsewhere.received == []
    for target in (f"http://{other}/v1/other/x", f"//{other}/v1/other/x"):
        raw(
            shim,
            f"POST {target} HTTP/1.1\r\nHost: {other}\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n".encode(),
        )
    assert elsewhere.received == []
    assert all(r.path.startswith("/v1/") for r in upstream.received)


def test_host_and_forwarding_headers_do_not_redirect_the_request(
    shim_with: Callable[..., Running], upstream: Any, elsewhere: Any
) -> None:
    shim = shim_with()
    other = elsewhere.url.removeprefix("http://")
    response = http.post(
        shim.url + CHAT,
        json=GOOD,
        headers={
            "host": other,
            "x-forwarded-host": other,
            "forwarded": f"host={other}",
            "x-original-url": "/admin",
            "x-rewrite-url": "/admin",
        },
    )
    assert response.status_code == 200
    assert elsewhere.received == []
    (got,) = upstream.received
    assert got.path == CHAT
    sent_host = dict(got.headers)["host"]
    assert sent_host == upstream.url.removeprefix("http://")


TRAVERSALS = [
    "/v1/../health",
    "/v1/%2e%2e/health",
    "/v1/%2E%2E/%2E%2E/etc/passwd",
    "/v1/..%2fhealth",
    "/v1/%2e%2e%2fhealth",
    "/v1/%252e%252e/health",
    "/v1/%252e%252e%252fhealth",
    "/v1/other/..%5c..%5chealth",
    "/v1/other/%5c..%5c..%5chealth",
    "/v1/./../health",
    "/v1/other/%00/x",
    "/v1/other/%0d%0aX-Injected:%201",
    "/v2/anything",
    "/V1/models",
    "/admin",
    "/v1",
    "/sim/reset",
]


@pytest.mark.parametrize("target", TRAVERSALS)
def test_traversal_and_encoded_paths_never_leave_v1(
    shim_with: Callable[..., Running], upstream: Any, target: str
) -> None:
    shim = shim_with()
    status, body = raw(shim, f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    assert status in (400, 404)
    assert json.loads(body)["error"]["message"]
    assert upstream.received == []


def test_dot_free_v1_paths_are_still_forwarded_with_their_query(
    shim_with: Callable[..., Running], upstream: Any
) -> None:
    shim = shim_with()
    response = http.get(shim.url + "/v1/other/files%20x/y?limit=2&after=a%2Fb")
    assert response.status_code == 200
    (got,) = upstream.received
    assert got.path == "/v1/other/files x/y"
    assert got.query == "limit=2&after=a%2Fb"


def test_hop_by_hop_and_proxy_headers_are_not_forwarded_and_via_is_added(
    shim_with: Callable[..., Running], upstream: Any
) -> None:
    shim = shim_with()
    response = http.post(
        shim.url + CHAT,
        json=GOOD,
        headers={
            "connection": "keep-alive, x-conn-named",
            "x-conn-named": "secret",
            "keep-alive": "timeout=5",
            "te": "trailers",
            "trailer": "x-t",
            "upgrade": "h2c",
            "proxy-authorization": "Basic c2VjcmV0",
            "proxy-connection": "keep-alive",
            "authorization": "Bearer sk-upstream",
            "x-end-to-end": "kept",
        },
    )
    assert response.status_code == 200
    assert response.headers["via"] == "1.1 llm-backoff-shim"
    (got,) = upstream.received
    names = {name.lower() for name, _ in got.headers}
    for hop in (
        "x-conn-named",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
    ):
        assert hop not in names
    sent = dict(got.headers)
    assert sent["authorization"] == "Bearer sk-upstream"  # end-to-end: forwarded
    assert sent["x-end-to-end"] == "kept"
    assert sent["via"] == "1.1 llm-backoff-shim"


def test_conflicting_framing_cannot_smuggle_a_second_request(
    shim_with: Callable[..., Running], upstream: Any
) -> None:
    shim = shim_with()
    smuggled = b"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    head = (
        b"POST /v1/other/x HTTP/1.1\r\nHost: x\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((shim.server.host, shim.server.port), timeout=10) as sock:
        sock.sendall(head + body)
        while sock.recv(65536):
            pass
    assert all(r.path.startswith("/v1/") for r in upstream.received)
    assert "/admin" not in upstream.paths()


# -- API keys --------------------------------------------------------------------------------


def test_without_a_key_401_comes_before_any_queueing(
    shim_with: Callable[..., Running], upstream: Any, waiter: Callable[..., None]
) -> None:
    shim = shim_with(api_key="sk-right", max_concurrency=1, max_queue=1)
    held = httpx.Client(timeout=30)
    import threading

    results: list[int] = []

    def hold() -> None:
        results.append(
            held.post(
                shim.url + CHAT, json=GOOD, headers={"authorization": "Bearer sk-right", "x-fake-hold": "1"}
            ).status_code
        )

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    c = shim.runtime.controller
    waiter(lambda: (c.in_flight(), c.queued()) == (1, 1), what="slot and queue full")
    for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": "Basic sk-right"}):
        response = http.post(shim.url + CHAT, json=GOOD, headers=headers)
        assert response.status_code == 401  # not 429: refused before admission
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert (c.in_flight(), c.queued()) == (1, 1)
    unauthenticated_models = http.get(shim.url + "/v1/models")
    assert unauthenticated_models.status_code == 401
    upstream.release()
    for t in threads:
        t.join(10)
    held.close()
    assert results == [200, 200]
    assert len(upstream.received) == 2
    assert http.get(shim.url + "/health").status_code == 200  # probes stay open


def test_openai_sdk_with_the_right_key_works_and_wrong_key_gets_authentication_error(
    shim_with: Callable[..., Running], tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# team a\nsk-team-a\n\n  sk-team-b  \n")
    shim = shim_with(api_keys_file=str(keys))
    for key in ("sk-team-a", "sk-team-b"):
        client = openai.OpenAI(base_url=shim.url + "/v1", api_key=key, max_retries=0)
        assert client.models.list().data[0].id == "fake"
    wrong = openai.OpenAI(base_url=shim.url + "/v1", api_key="sk-team-c", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.code == "invalid_api_key"
    text = http.get(shim.url + "/metrics").text
    assert 'llm_backoff_shim_bad_requests_total{reason="unauthorized"} 1.0' in text


def test_keys_file_errors_are_config_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_settings(["--api-keys-file", str(empty)])
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(["--api-keys-file", str(tmp_path / "missing")])
    spaced = tmp_path / "spaced"
    spaced.write_text("sk one\n")
    with pytest.raises(KeysFileError, match="whitespace"):
        read_keys_file(spaced)


def test_key_helpers() -> None:
    keys = ApiKeys(["sk-a", "sk-b"])
    assert keys.enabled
    assert keys.check(b"sk-a")
    assert keys.check(b"sk-b")
    assert not keys.check(b"sk-c")
    assert not keys.check(None)
    assert not ApiKeys([]).enabled
    assert bearer_token([(b"authorization", b"Bearer  sk-a ")]) == b"sk-a"
    assert bearer_token([(b"authorization", b"bearer sk-a")]) == b"sk-a"
    assert bearer_token([(b"authorization", b"Basic sk-a")]) is None
    assert bearer_token([(b"authorization", b"Bearer")]) is None
    assert bearer_token([]) is None
    ident = key_id("sk-a")
    assert ident.startswith("sha256:")
    assert len(ident) == len("sha256:") + 12
    assert "sk-a" not in ident
    assert key_id("sk-a") == key_id(b"sk-a") != key_id("sk-b")
    assert "sk-secret" not in repr(ShimSettings(api_key="sk-secret"))


def test_no_key_or_prompt_text_reaches_logs_or_metrics(
    shim_with: Callable[..., Running], upstream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    secret_key, wrong_key = "sk-live-TOPSECRET-1234", "sk-guess-WRONGKEY-5678"
    prompt = "PROMPT-MARKER-the-launch-codes-are-0000"
    caplog.set_level(logging.DEBUG)
    # log_config=None: uvicorn's loggers (access log included) propagate to caplog at debug.
    shim = shim_with(
        {"log_config": None, "log_level": "debug"}, api_key=secret_key, log_level="debug", max_body_bytes=2048
    )
    good = {"authorization": f"Bearer {secret_key}"}
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
    assert http.post(shim.url + CHAT, json=body, headers=good).status_code == 200
    assert (
        http.post(shim.url + CHAT, json=body, headers={"authorization": f"Bearer {wrong_key}"}).status_code
        == 401
    )
    broken = json.dumps(body).encode()[:-3]
    assert (
        http.post(
            shim.url + CHAT, content=broken, headers={**good, "content-type": "application/json"}
        ).status_code
        == 400
    )
    huge = json.dumps({"messages": [{"content": prompt * 100}]}).encode()
    assert http.post(shim.url + CHAT, content=huge, headers=good).status_code == 413
    assert http.post(shim.url + CHAT, json=body, headers={**good, "x-fake-status": "500"}).status_code == 500
    assert (
        http.post(shim.url + CHAT, json=body, headers={**good, "x-request-class": prompt}).status_code == 400
    )
    metrics = http.get(shim.url + "/metrics").text
    logged = caplog.text + "\n".join(str(r.args) for r in caplog.records)
    for secret in (secret_key, wrong_key, prompt, "TOPSECRET", "WRONGKEY", "launch-codes"):
        assert secret not in logged
        assert secret not in metrics
    # The refused key is identifiable by its short hash only.
    assert key_id(wrong_key) in caplog.text
    assert json.loads(upstream.received[0].body) == body  # the prompt did go upstream


# -- metrics and health on their own port ----------------------------------------------------


def _port_closed_on_127_0_0_1() -> tuple[int, socket.socket]:
    """A port free on 127.0.0.2, and a socket bound (not listening) to the same port on 127.0.0.1:
    while it is open nothing else can listen there, so a connection to it is refused."""
    for _ in range(20):
        port = free_port("127.0.0.2")
        guard = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            guard.bind(("127.0.0.1", port))
        except OSError:
            guard.close()
            continue
        return port, guard
    raise AssertionError("no port free on both 127.0.0.1 and 127.0.0.2")


def test_metrics_and_health_can_live_on_their_own_port(upstream: Any) -> None:
    port = free_port()
    settings = ShimSettings(upstream=upstream.url, metrics_port=port, log_level="warning")
    app = create_app(settings)
    with shim_server(app) as shim:
        assert http.get(shim.url + "/metrics").status_code == 404
        assert http.get(shim.url + "/shim/state").status_code == 404
        assert http.get(shim.url + "/health").status_code == 200
        assert http.post(shim.url + CHAT, json=GOOD).status_code == 200
        text = http.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'llm_backoff_shim_requests_total{class="interactive",code="",outcome="completed"} 1.0' in text
        assert http.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}
        state = http.get(f"http://127.0.0.1:{port}/shim/state").json()
        assert state["classes"]["interactive"] == {"in_flight": 0, "queued": 0}
        # The same document as on the main listener.
        assert set(state) == {"limit", "service_time_s", "overtaken", "classes", "answer_tokens"}
        assert state["overtaken"] == 0
        assert http.get(f"http://127.0.0.1:{port}/v1/models").status_code == 404
        assert http.post(f"http://127.0.0.1:{port}/metrics").status_code == 405


def test_the_operations_listener_keeps_the_head_limits_and_stops_with_the_app(upstream: Any) -> None:
    port = free_port()
    settings = ShimSettings(upstream=upstream.url, metrics_port=port, log_level="warning")
    app = create_app(settings, tuning=Tuning(max_header_bytes=2048))
    with shim_server(app) as shim:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: ops\r\nx-pad: " + b"a" * 4000)
            assert sock.recv(65536).startswith(b"HTTP/1.1 431 ")
            assert sock.recv(65536) == b""  # closed
        metrics = http.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'llm_backoff_shim_bad_requests_total{reason="headers_too_large"} 1.0' in metrics
        assert http.get(shim.url + "/health").status_code == 200
    # The app's lifespan closed it with the proxy's listener.
    with pytest.raises(httpx.ConnectError):
        http.get(f"http://127.0.0.1:{port}/health")


def test_the_operations_listener_answers_only_while_the_proxys_loop_runs(upstream: Any) -> None:
    """It is served by the proxy's own event loop: a stuck loop fails its health probe."""
    port = free_port()
    app = create_app(ShimSettings(upstream=upstream.url, metrics_port=port, log_level="warning"))
    health = f"http://127.0.0.1:{port}/health"
    with shim_server(app) as shim:
        assert httpx.get(health, timeout=10).status_code == 200
        assert shim.loop is not None
        release = threading.Event()
        shim.loop.call_soon_threadsafe(release.wait)  # the loop stops here until released
        try:
            with pytest.raises(httpx.TimeoutException):
                httpx.get(health, timeout=0.5)  # cannot be answered while the loop is stopped
        finally:
            release.set()
        assert httpx.get(health, timeout=10).status_code == 200


def test_serve_serves_the_metrics_port_on_host(upstream: Any) -> None:
    port = free_port("127.0.0.2")
    metrics_port, guard = _port_closed_on_127_0_0_1()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llm_backoff_shim.cli",
            "serve",
            "--port",
            str(port),
            "--upstream",
            upstream.url,
            "--host",
            "127.0.0.2",
            "--metrics-port",
            str(metrics_port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                metrics = http.get(f"http://127.0.0.2:{metrics_port}/metrics")
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.05)
        assert "llm_backoff_shim_bad_requests_total" in metrics.text
        deadline = time.monotonic() + 20
        while True:
            try:
                health = http.get(f"http://127.0.0.2:{port}/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "proxy listener did not come up"
                time.sleep(0.05)
        assert health.status_code == 200
        assert http.get(f"http://127.0.0.2:{port}/metrics").status_code == 404
        with pytest.raises(httpx.ConnectError):
            http.get(f"http://127.0.0.1:{metrics_port}/metrics")  # only on --host
    finally:
        guard.close()
        proc.terminate()
        proc.communicate(timeout=15)


def test_hop_by_hop_fields_of_the_upstream_response_are_dropped() -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(
            {"object": "list", "data": []},
            headers={
                "connection": "x-hop-named",
                "x-hop-named": "connection-specific",
                "keep-alive": "timeout=5",
                "proxy-authenticate": "Basic",
                "trailer": "x-t",
                "x-end-to-end": "kept",
            },
        )

    upstream_app = Starlette(routes=[Route("/v1/models", models)])
    with ServerThread(upstream_app) as up:
        app = create_app(ShimSettings(upstream=up.url, log_level="warning"))
        with shim_server(app) as shim:
            response = http.get(shim.url + "/v1/models")
    assert response.status_code == 200
    for hop in ("x-hop-named", "keep-alive", "proxy-authenticate", "trailer"):
        assert hop not in response.headers
    assert response.headers.get("connection") in (None, "keep-alive")
    assert response.headers["x-end-to-end"] == "kept"
    assert response.headers["via"] == "1.1 llm-backoff-shim"


def test_serve_refuses_a_taken_metrics_port_with_a_clear_error(upstream: Any) -> None:
    port = free_port()
    with free_socket() as taken:
        metrics_port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "llm_backoff_shim.cli",
                "serve",
                "--port",
                str(port),
                "--upstream",
                upstream.url,
                "--metrics-port",
                str(metrics_port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{metrics_port}" in result.stderr
