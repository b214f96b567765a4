"""The serving protocol's direct path for ``/v1/`` requests, on a raw socket to a real shim.

Each test drives bytes the way unusual but valid clients do (pipelining, ``Expect:
100-continue``, HTTP/1.0, encoded paths) and checks that the direct path and uvicorn's
own path (``/health`` and friends) answer exactly as the protocol requires, and that
every slot comes back.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from llm_backoff_shim.serve.app import create_app
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.serving import shim_server

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def chat(*, version: bytes = b"1.1", extra: bytes = b"", body: bytes = BODY) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/" + version + b"\r\nhost: shim\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body
    )


def test_pipelined_requests_mixing_both_paths_are_answered_in_order(
    upstream: Any, make_shim: Callable[..., Any], answers: Any
) -> None:
    shim = make_shim(upstream.url)
    with socket.create_connection(("127.0.0.1", shim.server.port), timeout=10) as sock:
        sock.sendall(
            chat()
            + b"GET /health HTTP/1.1\r\nhost: shim\r\n\r\n"
            + b"GET /v1/models HTTP/1.1\r\nhost: shim\r\n\r\n"
            + chat(body=b'{"model":"second"}')
        )
        answers = answers(sock, 4)
    assert [status for status, _, _ in answers] == [200, 200, 200, 200]
    assert json.loads(answers[0][2])["echo"]["messages"][0]["content"] == "hi"
    assert json.loads(answers[1][2]) == {"status": "ok"}
    assert json.loads(answers[2][2])["data"][0]["id"] == "fake"
    assert json.loads(answers[3][2])["echo"] == {"model": "second"}
    assert shim.state()["interactive"] == (0, 0)


def test_expect_100_continue_gets_its_interim_answer_before_the_body(
    upstream: Any, make_shim: Callable[..., Any], answers: Any
) -> None:
    shim = make_shim(upstream.url)
    with socket.create_connection(("127.0.0.1", shim.server.port), timeout=10) as sock:
        request = chat(extra=b"expect: 100-continue\r\n")
        head, _, body = request.partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")
        interim = b""
        while b"\r\n\r\n" not in interim:
            data = sock.recv(64)
            assert data
            interim += data
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        leftover = interim[len(b"HTTP/1.1 100 Continue\r\n\r\n") :]
        assert leftover == b""
        [(status, _, answer)] = answers(sock, 1)
    assert status == 200
    assert json.loads(answer)["echo"]["model"] == "m"


def test_an_http_1_0_request_is_answered_and_the_connection_closed(
    upstream: Any, make_shim: Callable[..., Any], answers: Any
) -> None:
    shim = make_shim(upstream.url)
    with socket.create_connection(("127.0.0.1", shim.server.port), timeout=10) as sock:
        sock.sendall(chat(version=b"1.0"))
        [(status, headers, _)] = answers(sock, 1)
        assert status == 200
        assert headers.get("connection") == "close"
        assert sock.recv(1) == b""  # closed after the answer


def test_a_body_split_over_several_writes_reaches_the_engine_whole(
    upstream: Any, make_shim: Callable[..., Any], answers: Any
) -> None:
    shim = make_shim(upstream.url)
    content = "x" * 200_000
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    with socket.create_connection(("127.0.0.1", shim.server.port), timeout=10) as sock:
        request = chat(body=body)
        for at in range(0, len(request), 7_000):
            sock.sendall(request[at : at + 7_000])
        [(status, _, answer)] = answers(sock, 1)
    assert status == 200
    assert json.loads(answer)["echo"]["messages"][0]["content"] == content


def test_an_encoded_line_break_in_the_path_is_refused_in_openai_format(
    upstream: Any, make_shim: Callable[..., Any], answers: Any
) -> None:
    shim = make_shim(upstream.url)
    with socket.create_connection(("127.0.0.1", shim.server.port), timeout=10) as sock:
        sock.sendall(
            b"GET /v1/a%0Ab HTTP/1.1\r\nhost: shim\r\n\r\nGET /v1/models HTTP/1.1\r\nhost: shim\r\n\r\n"
        )
        (status, _, body), (after, _, _) = answers(sock, 2)
    assert status == 404
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert after == 200  # the connection still serves
    assert upstream.paths() == []


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(
    upstream: Any, answers: Any
) -> None:
    app = create_app(ShimSettings(upstream=upstream.url, log_level="warning"))
    with (
        shim_server(app, timeout_keep_alive=1) as shim,
        socket.create_connection(("127.0.0.1", shim.port), timeout=10) as sock,
    ):
        sock.sendall(chat())
        [(status, _, _)] = answers(sock, 1)
        assert status == 200
        # Never early: the timeout counts from the end of the answer.
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(1)
        # Closed, not answered: the bound only stops a broken test from hanging.
        sock.settimeout(10)
        assert sock.recv(1) == b""


def test_a_request_before_the_keep_alive_timeout_keeps_the_connection(upstream: Any, answers: Any) -> None:
    app = create_app(ShimSettings(upstream=upstream.url, log_level="warning"))
    with (
        shim_server(app, timeout_keep_alive=2) as shim,
        socket.create_connection(("127.0.0.1", shim.port), timeout=10) as sock,
    ):
        for _ in range(6):
            sock.sendall(chat())
            [(status, _, _)] = answers(sock, 1)
            assert status == 200
            time.sleep(0.6)  # well under the timeout, 3.6 s in all: each request re-arms the idle timer


def test_shutdown_lets_a_stream_in_flight_finish_then_closes_its_connection(upstream: Any) -> None:
    app = create_app(ShimSettings(upstream=upstream.url, log_level="warning"))
    shim = shim_server(app, timeout_graceful_shutdown=10).start()
    stopper = threading.Thread(target=shim.stop, kwargs={"timeout": 15})
    try:
        with socket.create_connection(("127.0.0.1", shim.port), timeout=10) as sock:
            body = b'{"model":"m","stream":true,"messages":[]}'
            sock.sendall(chat(extra=b"x-fake-chunks: 20\r\nx-fake-step: 0.05\r\n", body=body))
            received = b""
            while b"data:" not in received:
                data = sock.recv(65536)
                assert data
                received += data
            stopper.start()  # mid-stream: the server stops taking work, but this answer is owed
            while not received.endswith(b"\r\n0\r\n\r\n"):
                data = sock.recv(65536)
                assert data, "stream cut by the shutdown"
                received += data
            assert received.count(b"data:") == 21  # 20 chunks and [DONE]
            assert sock.recv(1) == b""  # then the connection is closed, not kept alive
    finally:
        if stopper.ident is not None:
            stopper.join(20)
        else:
            shim.stop()
    with pytest.raises(ConnectionRefusedError):  # and it takes no new connection
        socket.create_connection(("127.0.0.1", shim.port), timeout=2).close()
