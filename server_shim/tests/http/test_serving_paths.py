"""The two serving paths: the start-up check, the choice between them, and what only the public one has.

The end-to-end suite runs on either path (``--shim-http-path``); these tests pin what
the choice itself must do, whatever the run's path: the check catches a changed
internal, a forced fast path refuses to start without it, ``auto`` falls back with one
warning, and the public path keeps its own bookkeeping bounded.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from llm_backoff_shim.http import capability, paths
from llm_backoff_shim.http.public_app import PublicApp
from llm_backoff_shim.serve import command
from llm_backoff_shim.serve.app import create_app
from llm_backoff_shim.serve.command import shim_serving
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.tuning import TUNING, Tuning
from llm_backoff_shim.serve.serving import ServerThread

SRC = Path(__file__).resolve().parents[2] / "src" / "llm_backoff_shim"
# The reaches into a dependency's internals the project's hook looks for.
PRIVATE_USE = re.compile(
    r"uvicorn\.protocols|_start_asgi_task|HttpToolsProtocol|RequestResponseCycle"
    r"|from (uvicorn|starlette|aiohttp|httpx2?|openai|granian)[.a-z_]* import _[a-z]"
)
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def test_every_reach_into_a_dependency_s_internals_lives_in_the_http_subpackage() -> None:
    places = {
        path.relative_to(SRC).parts[0] if len(path.relative_to(SRC).parts) > 1 else "(top folder)"
        for path in SRC.rglob("*.py")
        if PRIVATE_USE.search(path.read_text())
    }
    assert places == {"http"}


def test_the_shim_and_its_public_path_import_no_uvicorn_protocol_module() -> None:
    """Only the fast path (built after the check) loads uvicorn's protocol modules."""
    code = (
        "import sys\n"
        "import llm_backoff_shim.serve.command, llm_backoff_shim.serve.request_path.proxy\n"
        "import llm_backoff_shim.http.public_app\n"
        "print(sorted(m for m in sys.modules if m.startswith('uvicorn.protocols')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


@pytest.mark.fast_path
def test_the_check_names_an_internal_that_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert capability._check_names() is None
    monkeypatch.delattr(HttpToolsProtocol, "on_response_complete")
    assert capability._check_names() == "HttpToolsProtocol.on_response_complete is missing"


@pytest.mark.fast_path
def test_the_check_names_a_changed_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    monkeypatch.setattr(HttpToolsProtocol, "send_400_response", lambda self, msg, status: None)
    problem = capability._check_names()
    assert problem is not None
    assert "send_400_response" in problem


@pytest.mark.fast_path
def test_the_probe_catches_an_internal_that_behaves_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert capability._run_probe() is None
    # Same name and signature, but the next pipelined request is never started.
    monkeypatch.setattr(HttpToolsProtocol, "on_response_complete", lambda self: None)
    problem = capability._run_probe()
    assert problem is not None
    assert "pipelined" in problem


def test_a_forced_fast_path_refuses_to_start_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = "HttpToolsProtocol._start_asgi_task is missing"
    monkeypatch.setattr(capability, "fast_path_problem", lambda: missing)
    with pytest.raises(paths.FastPathUnavailable, match="_start_asgi_task is missing"):
        paths.choose_path("fast")
    assert paths.choose_path("public") == "public"


def test_serve_exits_with_a_message_when_the_forced_fast_path_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = "uvicorn's httptools protocol cannot be imported"
    monkeypatch.setattr(capability, "fast_path_problem", lambda: problem)
    # serve configures logging for its process; this one is pytest's.
    monkeypatch.setattr(command.logging.config, "dictConfig", lambda config: None)
    assert command.main(["--http-path", "fast", "--port", "0"]) == 2
    assert "the fast HTTP path is unavailable: uvicorn's httptools protocol" in capsys.readouterr().err


def test_auto_falls_back_to_the_public_path_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(capability, "fast_path_problem", lambda: "a problem only this test has")
    caplog.set_level(logging.WARNING, logger="llm_backoff_shim.http")
    settings = ShimSettings(log_level="warning", http_path="auto")
    first, second = shim_serving(create_app(settings)), shim_serving(create_app(settings))
    assert (first.path, second.path) == ("public", "public")
    assert isinstance(first.app, PublicApp)
    assert first.options["http"].__name__ == "PublicH11Protocol"
    assert first.options["proxy_headers"] is False
    warnings = [r for r in caplog.records if "a problem only this test has" in r.getMessage()]
    assert len(warnings) == 1
    assert "serving through the public path" in warnings[0].getMessage()


def _public_shim(upstream: Any, tuning: Tuning = TUNING, **settings: Any) -> tuple[ServerThread, PublicApp]:
    app = create_app(
        ShimSettings(upstream=upstream.url, log_level="warning", http_path="public", **settings),
        tuning=tuning,
    )
    served = shim_serving(app)
    assert isinstance(served.app, PublicApp)
    return ServerThread(served.app, **served.options), served.app


def test_the_public_path_forgets_each_connection_when_it_closes(upstream: Any, waiter: Any) -> None:
    server, public = _public_shim(upstream)
    with server:
        sockets = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(20)]
        for sock in sockets:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: shim\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert len(public.connections) == 20
        for sock in sockets:
            sock.close()
        waiter(lambda: not public.connections, what="the connection table to empty")


def test_the_public_path_answers_its_guard_events_as_the_fast_path_does(upstream: Any) -> None:
    server, _ = _public_shim(upstream, Tuning(max_header_bytes=2048))
    with server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: shim\r\nx-pad: " + b"a" * 4000)
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert b'"code":"headers_too_large"' in answer
        assert sock.recv(65536) == b""  # closed
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        assert 'llm_backoff_shim_bad_requests_total{reason="headers_too_large"} 1.0' in metrics


def test_the_public_path_reads_a_refused_body_as_body_never_as_a_head(upstream: Any, answers: Any) -> None:
    """A 401 sent before the body: the body that follows is read past, not answered as a request."""
    server, _ = _public_shim(upstream, Tuning(header_read_timeout=0.5), api_key="k")
    body = b"x" * 5000  # no blank line in it: as a head it would be timed out with a 408
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: shim\r\ncontent-length: %d\r\n\r\n" % len(body)
    with server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        assert answers(sock, 1)[0][0] == 401
        sock.sendall(body)
        time.sleep(1.0)  # past the head timeout: body bytes taken for a head would be cut off here
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: shim\r\n\r\n")
        assert answers(sock, 1)[0][0] == 200


@pytest.mark.parametrize(
    "head",
    [
        b"GET /v1/other/x\nX-Inj: 1 HTTP/1.1\r\nhost: shim\r\n\r\n",
        b"GET /v1/other/x HTTP/1.1\r\nhost: shim\r\nhost: other\r\n\r\n",
        b"GET /v1/other/x HTTP/1.1\r\n\r\n",
        b"GET /v1/other/x HTTP/9.9\r\nhost: shim\r\n\r\n",
    ],
    ids=["bare LF in the request line", "two Hosts", "no Host", "HTTP/9.9"],
)
def test_the_public_path_refuses_the_heads_nginx_refuses(upstream: Any, head: bytes) -> None:
    """/v1/other/... is recorded by the fake upstream: it must see none of them."""
    server, _ = _public_shim(upstream)
    with server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b'"code":"malformed_http"' in answer
    assert 'llm_backoff_shim_bad_requests_total{reason="malformed_http"} 1.0' in metrics
    assert upstream.received == []
