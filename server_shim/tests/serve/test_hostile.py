"""Hostile and malformed input against a real shim on loopback (uvicorn + the connection guard).

Each kind of bad input must get an OpenAI-format 4xx (or, where HTTP parsing itself
fails, an OpenAI-format 400/408/431 and a closed connection), be counted in
``llm_backoff_shim_bad_requests_total{reason}``, never reach the upstream, and leave
the shim serving everyone else with its gauges at zero.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from llm_backoff_shim.serve.app import ShimRuntime, create_app, shim_state
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.tuning import Tuning
from llm_backoff_shim.serve.serving import ServerThread, shim_server

CHAT = "/v1/chat/completions"
# One pooled client: a fresh httpx client per call costs tens of ms (TLS context set-up).
http = httpx.Client(timeout=10)
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class GuardedShim:
    server: ServerThread
    runtime: ShimRuntime

    @property
    def url(self) -> str:
        return self.server.url

    def bad_requests(self) -> dict[str, float]:
        text = http.get(self.url + "/metrics", timeout=5).text
        counts: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("llm_backoff_shim_bad_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                counts[labels.split('reason="')[1].split('"')[0]] = float(value)
        return counts

    def gauges(self) -> tuple[int, int]:
        c = self.runtime.controller
        return c.in_flight(), c.queued()


@pytest.fixture
def guarded(upstream: Any) -> Iterator[Callable[..., GuardedShim]]:
    servers: list[ServerThread] = []

    def factory(**settings: Any) -> GuardedShim:
        values: dict[str, Any] = {
            "upstream": upstream.url,
            "log_level": "warning",
            "max_body_bytes": 4096,
            "body_read_timeout": 0.5,
        }
        values.update(settings)
        app = create_app(
            ShimSettings(**values), tuning=Tuning(header_read_timeout=0.5, max_header_bytes=8192)
        )
        server = shim_server(app).start()
        servers.append(server)
        return GuardedShim(server, shim_state(app))

    yield factory
    for server in servers:
        server.stop()


def openai_error(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    return dict(error)


def still_serves(shim: GuardedShim) -> None:
    response = http.post(shim.url + CHAT, json=GOOD, timeout=10)
    assert response.status_code == 200
    assert response.json()["echo"] == GOOD


# -- ASGI-level checks (the request head was valid HTTP) ----------------------------------

BAD_BODIES: list[tuple[str, bytes, dict[str, str], int, str]] = [
    ("truncated JSON", b'{"model": "m", "messages": [', {}, 400, "invalid_json"),
    ("not JSON at all", b"model=m&prompt=hi", {}, 400, "invalid_json"),
    ("empty body", b"", {}, 400, "invalid_json"),
    ("JSON array", b"[1, 2, 3]", {}, 400, "invalid_json"),
    ("JSON string", b'"hello"', {}, 400, "invalid_json"),
    ("invalid UTF-8", b'{"model": "\xff\xfe"}', {}, 400, "invalid_json"),
    ("deep nesting", b"[" * 1500 + b"]" * 1500, {}, 400, "invalid_json"),
    ("NaN literal", b'{"n": NaN', {}, 400, "invalid_json"),
    ("text/plain", json.dumps(GOOD).encode(), {"content-type": "text/plain"}, 415, "unsupported_media_type"),
    (
        "form content type",
        b"a=1",
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        "unsupported_media_type",
    ),
    (
        "multipart",
        b"--x\r\n\r\n--x--",
        {"content-type": "multipart/form-data; boundary=x"},
        415,
        "unsupported_media_type",
    ),
    ("unknown class", json.dumps(GOOD).encode(), {"x-request-class": "vip"}, 400, "invalid_request_class"),
    (
        "class with CR-free junk",
        json.dumps(GOOD).encode(),
        {"x-request-class": "a" * 500},
        400,
        "invalid_request_class",
    ),
    (
        "budget not a number",
        json.dumps(GOOD).encode(),
        {"x-request-timeout-ms": "soon"},
        400,
        "invalid_header",
    ),
    ("negative budget", json.dumps(GOOD).encode(), {"x-request-timeout-ms": "-5"}, 400, "invalid_header"),
    ("NaN budget", json.dumps(GOOD).encode(), {"x-request-timeout-ms": "nan"}, 400, "invalid_header"),
    ("infinite budget", json.dumps(GOOD).encode(), {"x-request-timeout-ms": "inf"}, 400, "invalid_header"),
    (
        "overflowing budget",
        json.dumps(GOOD).encode(),
        {"x-request-timeout-ms": "1e400"},
        400,
        "invalid_header",
    ),
    (
        "unknown budget scope",
        json.dumps(GOOD).encode(),
        {"x-request-timeout-ms": "5000", "x-request-timeout-scope": "first-token"},
        400,
        "invalid_header",
    ),
    ("oversized body", b'{"p": "' + b"x" * 5000 + b'"}', {}, 413, "body_too_large"),
]


@pytest.mark.parametrize(
    ("body", "headers", "status", "reason"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_request_gets_openai_4xx_is_counted_and_never_forwarded(
    guarded: Callable[..., GuardedShim],
    upstream: Any,
    body: bytes,
    headers: dict[str, str],
    status: int,
    reason: str,
) -> None:
    shim = guarded()
    before = shim.bad_requests()
    send_headers = {"content-type": "application/json", **headers}
    response = http.post(shim.url + CHAT, content=body, headers=send_headers, timeout=10)
    assert response.status_code == status
    error = openai_error(response)
    assert error["type"] == "invalid_request_error"
    after = shim.bad_requests()
    assert after[reason] == before[reason] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    assert upstream.received == []
    assert shim.gauges() == (0, 0)
    still_serves(shim)


def test_missing_content_type_and_missing_or_huge_budget_are_accepted(
    guarded: Callable[..., GuardedShim], upstream: Any
) -> None:
    """Choices: vLLM accepts a JSON body without Content-Type, so does the shim; no budget header
    means no budget; a finite huge budget is simply longer than any queue wait."""
    shim = guarded()
    plain = http.post(shim.url + CHAT, content=json.dumps(GOOD).encode(), timeout=10)
    assert plain.status_code == 200
    huge = http.post(shim.url + CHAT, json=GOOD, headers={"x-request-timeout-ms": "1e300"}, timeout=10)
    assert huge.status_code == 200
    scoped = {"x-request-timeout-ms": "9000", "x-request-timeout-scope": "Start"}
    assert http.post(shim.url + CHAT, json=GOOD, headers=scoped, timeout=10).status_code == 200
    vendor_json = http.post(
        shim.url + CHAT,
        content=json.dumps(GOOD).encode(),
        headers={"content-type": "application/vnd.api+json; charset=utf-8"},
        timeout=10,
    )
    assert vendor_json.status_code == 200
    assert sum(shim.bad_requests().values()) == 0
    assert len(upstream.received) == 4


def test_spent_budget_is_a_429_not_a_client_error(guarded: Callable[..., GuardedShim], upstream: Any) -> None:
    shim = guarded()
    response = http.post(shim.url + CHAT, json=GOOD, headers={"x-request-timeout-ms": "0"}, timeout=10)
    assert response.status_code == 429
    assert openai_error(response)["code"] == "queue_timeout"
    assert "retry-after" in response.headers
    assert upstream.received == []


def test_chunked_oversized_body_is_cut_at_the_limit(
    guarded: Callable[..., GuardedShim], upstream: Any
) -> None:
    shim = guarded()

    def chunks() -> Iterator[bytes]:
        yield b'{"p": "'
        for _ in range(100):
            yield b"x" * 1000  # no Content-Length: only the running count can stop it
        yield b'"}'

    response = http.post(
        shim.url + CHAT, content=chunks(), headers={"content-type": "application/json"}, timeout=10
    )
    assert response.status_code == 413
    assert openai_error(response)["code"] == "request_too_large"
    assert response.headers["x-llm-backoff-refusal"] == "final-request-too-large"
    assert shim.bad_requests()["body_too_large"] == 1
    assert upstream.received == []
    still_serves(shim)


def test_non_generation_paths_have_the_body_limit_too(
    guarded: Callable[..., GuardedShim], upstream: Any
) -> None:
    shim = guarded()
    response = http.post(shim.url + "/v1/other/upload", content=b"x" * 10_000, timeout=10)
    assert response.status_code == 413
    assert upstream.received == []


# -- connection-level checks (raw sockets: the head itself is the problem) -----------------


def raw_exchange(shim: GuardedShim, payload: bytes, *, pause_after: bool = False) -> bytes:
    """Send ``payload``, then read until the server closes (bounded by a generous socket timeout)."""
    with socket.create_connection((shim.server.host, shim.server.port), timeout=10) as sock:
        sock.sendall(payload)
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
        return received


def parse_raw(response: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return status, headers, json.loads(body)


def test_slow_loris_head_gets_408_and_is_closed_while_others_are_served(
    guarded: Callable[..., GuardedShim], upstream: Any
) -> None:
    shim = guarded()
    with socket.create_connection((shim.server.host, shim.server.port), timeout=10) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        still_serves(shim)  # the half-open head does not block anyone
        received = b""
        while chunk := slow.recv(65536):
            received += chunk
    status, headers, body = parse_raw(received)
    assert status == 408
    assert headers["connection"] == "close"
    assert body["error"]["code"] == "header_timeout"
    assert shim.bad_requests()["header_timeout"] == 1
    assert [r.path for r in upstream.received] == [CHAT]  # only the good request


def test_idle_connection_that_never_sends_a_byte_is_closed_quietly(
    guarded: Callable[..., GuardedShim],
) -> None:
    """Choice: a connection with no byte at all is a pool's spare, not an attack: closed, not counted."""
    shim = guarded()
    assert raw_exchange(shim, b"") == b""
    assert shim.bad_requests()["header_timeout"] == 0
    still_serves(shim)


def test_slow_head_on_a_kept_alive_connection_is_timed_out_too(guarded: Callable[..., GuardedShim]) -> None:
    shim = guarded()
    first = json.dumps(GOOD).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(first)).encode() + b"\r\n\r\n" + first
    )
    with socket.create_connection((shim.server.host, shim.server.port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while b'"echo"' not in received:
            received += sock.recv(65536)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHo")  # then nothing more
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
    assert rest.startswith(b"HTTP/1.1 408")
    assert shim.bad_requests()["header_timeout"] == 1


def test_slow_body_gets_408(guarded: Callable[..., GuardedShim], upstream: Any) -> None:
    shim = guarded()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    status, _, body = parse_raw(raw_exchange(shim, head + b'{"model": '))
    assert status == 408
    assert body["error"]["code"] == "body_timeout"
    assert shim.bad_requests()["body_timeout"] == 1
    assert upstream.received == []
    assert shim.gauges() == (0, 0)
    still_serves(shim)


def test_a_client_leaving_mid_body_is_counted_and_never_forwarded(
    guarded: Callable[..., GuardedShim], upstream: Any, waiter: Callable[..., None]
) -> None:
    shim = guarded()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    with socket.create_connection((shim.server.host, shim.server.port), timeout=10) as sock:
        sock.sendall(head + b'{"model": ')

    def counted() -> bool:
        text = http.get(shim.url + "/metrics").text
        line = 'llm_backoff_shim_requests_total{class="interactive",code="",outcome="client_disconnected"}'
        return f"{line} 1.0" in text

    waiter(counted, what="client_disconnected counted")
    assert sum(shim.bad_requests().values()) == 0  # leaving is not an attack
    assert upstream.received == []
    assert shim.gauges() == (0, 0)


@pytest.mark.parametrize(
    "head",
    [
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-%d: v\r\n" % i for i in range(3000))
        + b"\r\n",
        b"GET /v1/" + b"m" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["one huge header", "thousands of headers", "huge request line"],
)
def test_enormous_heads_get_431(guarded: Callable[..., GuardedShim], upstream: Any, head: bytes) -> None:
    shim = guarded()
    status, headers, body = parse_raw(raw_exchange(shim, head))
    assert status == 431
    assert headers["connection"] == "close"
    assert body["error"]["code"] == "headers_too_large"
    assert headers["x-llm-backoff-refusal"] == "final-headers-too-large"
    assert shim.bad_requests()["headers_too_large"] == 1
    assert upstream.received == []
    still_serves(shim)


@pytest.mark.parametrize(
    "head",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /v1/models HTTP/9.9\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nBad Header Name: x\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"GET /v1/mo\x00dels HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["no request line", "bad version", "space in header name", "bad content-length", "NUL in target"],
)
def test_unparsable_http_gets_openai_400_and_close(
    guarded: Callable[..., GuardedShim], upstream: Any, head: bytes
) -> None:
    shim = guarded()
    status, headers, body = parse_raw(raw_exchange(shim, head))
    assert status == 400
    assert headers["connection"] == "close"
    assert body["error"]["code"] == "malformed_http"
    assert shim.bad_requests()["malformed_http"] == 1
    assert upstream.received == []
    still_serves(shim)


def test_a_mixed_barrage_leaves_the_shim_serving_with_gauges_at_zero(
    guarded: Callable[..., GuardedShim], upstream: Any
) -> None:
    shim = guarded()
    for _ in range(3):
        for _, body, headers, status, _ in BAD_BODIES:
            response = http.post(
                shim.url + CHAT,
                content=body,
                headers={"content-type": "application/json", **headers},
                timeout=10,
            )
            assert response.status_code == status
        raw_exchange(shim, b"GARBAGE\r\n\r\n")
        still_serves(shim)
    counts = shim.bad_requests()
    assert sum(counts.values()) == 3 * (len(BAD_BODIES) + 1)
    assert shim.gauges() == (0, 0)
    assert [r.path for r in upstream.received] == [CHAT] * 3


def test_a_body_refused_unread_still_gets_its_answer_not_a_reset(guarded: Callable[..., GuardedShim]) -> None:
    """413 while the client is still sending: the answer must reach the client.

    The shim refuses the declared length before reading the body and closes the
    connection with body bytes still unread; the client, which sent the whole body
    first, must still read the 413 and its JSON, and the shim keep serving.
    """
    shim = guarded()
    body = b"x" * (2 << 20)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: shim\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    for _ in range(5):
        with socket.create_connection((shim.server.host, shim.server.port), timeout=10) as sock:
            # The whole body at once: more than the shim buffers before it stops reading,
            # so bytes are still unread in its socket when it has answered.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(head + body)
            received = b""
            while not received.endswith(b"}}") and b"request_too_large" not in received:
                chunk = sock.recv(65536)  # a reset here is the failure this test is about
                if not chunk:
                    break
                received += chunk
        assert received.startswith(b"HTTP/1.1 413"), received[:200]
        assert b"request_too_large" in received
    still_serves(shim)


def test_the_rest_of_a_refused_body_is_read_past_before_the_connection_closes(
    guarded: Callable[..., GuardedShim], upstream: Any
) -> None:
    """After a 413 refused from the declared length, the shim keeps reading (and dropping) what
    the client still sends, as nginx's lingering close does: a socket closed with unread bytes
    is reset, and a reset can reach the client before the answer. The client here reads its
    413 first, then sends its body in pieces: none of them meets a reset, and the connection
    closes once the client is done."""
    shim = guarded()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: shim\r\ncontent-type: application/json\r\n"
        b"content-length: 5000\r\n\r\n"
    )
    with socket.create_connection((shim.server.host, shim.server.port), timeout=10) as sock:
        sock.sendall(head)
        received = b""
        while not received.endswith(b"}}"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        for _ in range(5):
            time.sleep(0.05)  # each piece after the shim has had time to close, were it not lingering
            sock.sendall(b"x" * 1000)  # a reset raises here
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):  # then the shim closes: EOF, not a reset
            pass
    status, headers, error = parse_raw(received)
    assert status == 413
    assert headers.get("connection") == "close"
    assert error["error"]["code"] == "request_too_large"
    assert upstream.received == []
    still_serves(shim)
