"""Hostile input on the wire, answered as nginx does or better, against a real shim on loopback.

Raw client sockets in front, and behind the shim a raw upstream (:class:`RecordingUpstream`)
that records the exact bytes of every request it receives and answers as the test asks
through the request's path: at once, held until released, with an oversized or endless
response head, or with a stream that stalls. Shims come from conftest's ``make_shim``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from llm_backoff_shim.serve.config.tuning import Tuning

CHAT = "/v1/chat/completions"
GOOD = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


class RecordingUpstream:
    """A raw HTTP/1.1 upstream on loopback: records request bytes, answers by path.

    ``/v1/hold/...`` waits for :meth:`release`; an ``x-rec: NAME`` header picks ``/v1/NAME``'s
    behaviour whatever the path; ``/v1/big-head`` answers with a 2 MB header,
    ``/v1/many-headers`` with 20,000 headers, ``/v1/endless-head`` with a header that never
    ends; ``/v1/stall`` starts an SSE stream, sends one event and then nothing; anything else
    gets a small JSON 200. Connections are kept alive.
    """

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[bytes] = []
        self.closed_streams = 0
        self.endless_sent = 0
        self.endless_cut = False
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self._released.set()

    def heads(self) -> list[bytes]:
        with self._lock:
            return [request.partition(b"\r\n\r\n")[0] for request in self.requests]

    def close(self) -> None:
        self._stop = True
        self._released.set()
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn, contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                body, buffer = buffer[:length], buffer[length:]
                with self._lock:
                    self.requests.append(head + b"\r\n\r\n" + body)
                path = head.split(b" ")[1]
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"x-rec":
                        path = b"/v1/" + value.strip()  # the behaviour asked for by header
                if not self._answer(conn, path):
                    return

    def _answer(self, conn: socket.socket, path: bytes) -> bool:
        if path.startswith(b"/v1/hold/"):
            self._released.wait(30)
        if path == b"/v1/big-head":
            conn.sendall(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 2_000_000 + b"\r\ncontent-length: 0\r\n\r\n")
            return True
        if path == b"/v1/many-headers":
            lines = b"".join(b"x-h%d: v\r\n" % i for i in range(20_000))
            conn.sendall(b"HTTP/1.1 200 OK\r\n" + lines + b"content-length: 0\r\n\r\n")
            return True
        if path == b"/v1/endless-head":
            conn.sendall(b"HTTP/1.1 200 OK\r\nx-endless: ")
            while self.endless_sent < 256 << 20:
                try:
                    conn.sendall(b"a" * 65536)  # until the shim closes the connection
                except OSError:
                    self.endless_cut = True
                    break
                self.endless_sent += 65536
            return False
        if path == b"/v1/stall":
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + _chunk(b'data: {"i": 0}\n\n')
            )
            # Then silence: the shim must give up on its own and close the connection.
            while conn.recv(65536):
                pass
            with self._lock:
                self.closed_streams += 1
            return False
        body = b'{"ok":true}'
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n" + body
        )
        return True


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@pytest.fixture
def recording() -> Iterator[RecordingUpstream]:
    upstream = RecordingUpstream()
    try:
        yield upstream
    finally:
        upstream.close()


def connect(shim: Any) -> socket.socket:
    return socket.create_connection((shim.server.host, shim.server.port), timeout=20)


def read_until_closed(sock: socket.socket) -> bytes:
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


def split_answers(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Answers with a length, in order, from everything one connection received."""
    answers = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        length = int(headers.get("content-length", "0"))
        answers.append((int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    return answers


def bad_requests(shim: Any) -> dict[str, float]:
    return {
        dict(labels)["reason"]: value
        for (name, labels), value in shim.metrics().items()
        if name == "llm_backoff_shim_bad_requests_total"
    }


def serves(shim: Any, recording: RecordingUpstream) -> None:
    """Another client on its own connection gets its answer, and the request went upstream."""
    before = len(recording.requests)
    key = shim.runtime.settings.api_key
    auth = b"" if key is None else b"authorization: Bearer %b\r\n" % key.get_secret_value().encode()
    with connect(shim) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n%bconnection: close\r\n\r\n" % auth)
        ((status, _, body),) = split_answers(read_until_closed(sock))
    assert (status, body) == (200, b'{"ok":true}')
    assert len(recording.requests) == before + 1


def push_until_refused(sock: socket.socket, limit: int) -> int:
    """Send header bytes until ``limit`` or until the peer has read nothing for a second."""
    piece, sent = b"a" * 65536, 0
    while sent < limit:
        _, writable, _ = select.select([], [sock], [], 1.0)
        if not writable:
            break  # the shim stopped reading: everything on the way is full
        sent += sock.send(piece)
    return sent


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- a head pipelined behind an answer in progress -------------------------------------------


def test_an_endless_head_pipelined_behind_a_slow_answer_is_capped_after_that_answer(
    make_shim: Callable[..., Any], recording: RecordingUpstream, waiter: Callable[..., None]
) -> None:
    shim = make_shim(recording.url, tuning=Tuning(max_header_bytes=8192, header_read_timeout=60))
    sock = connect(shim)
    sock.sendall(b"GET /v1/hold/a HTTP/1.1\r\nhost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ")
    waiter(lambda: len(recording.requests) == 1, what="the first request upstream")
    before = rss_bytes()
    sent = push_until_refused(sock, 64 << 20)  # far more than any buffer on the way
    grown = rss_bytes() - before
    assert sent < 64 << 20, "the shim kept reading an endless head"
    assert grown < 16 << 20, f"the shim's memory grew by {grown} bytes"
    serves(shim, recording)  # everyone else is served meanwhile
    recording.release()
    answers = split_answers(read_until_closed(sock))
    sock.close()
    assert [status for status, _, _ in answers] == [200, 431]  # the answer in progress, then the refusal
    assert answers[0][2] == b'{"ok":true}'
    assert json.loads(answers[1][2])["error"]["code"] == "headers_too_large"
    assert answers[1][1]["connection"] == "close"
    assert bad_requests(shim)["headers_too_large"] == 1
    assert [head.split(b"\r\n")[0] for head in recording.heads()] == [
        b"GET /v1/hold/a HTTP/1.1",
        b"GET /v1/models HTTP/1.1",  # the other client's; the endless head never went upstream
    ]
    assert shim.state()["interactive"] == (0, 0)


def test_a_stalled_head_pipelined_behind_a_slow_answer_is_timed(
    make_shim: Callable[..., Any], recording: RecordingUpstream, waiter: Callable[..., None]
) -> None:
    shim = make_shim(recording.url, tuning=Tuning(header_read_timeout=0.5))
    with connect(shim) as sock:
        sock.sendall(b"GET /v1/hold/a HTTP/1.1\r\nhost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHo")
        waiter(lambda: len(recording.requests) == 1, what="the first request upstream")
        recording.release()
        answers = split_answers(read_until_closed(sock))
    assert [status for status, _, _ in answers] == [200, 408]
    assert json.loads(answers[1][2])["error"]["code"] == "header_timeout"
    assert bad_requests(shim)["header_timeout"] == 1
    assert len(recording.requests) == 1


def test_a_pipelined_request_in_the_same_read_as_a_body_is_still_served(
    make_shim: Callable[..., Any], recording: RecordingUpstream
) -> None:
    """The guard's head count restarts inside a read: a small pipelined head is not over any cap."""
    shim = make_shim(recording.url, tuning=Tuning(max_header_bytes=1024, header_read_timeout=5))
    body = b"x" * 3000
    first = b"POST /v1/other/a HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
    second = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    with connect(shim) as sock:
        sock.sendall(first + second)
        answers = split_answers(read_until_closed(sock))
    assert [status for status, _, _ in answers] == [200, 200]
    assert sum(bad_requests(shim).values()) == 0


# -- a refusal sent before the body arrived --------------------------------------------------


@pytest.mark.parametrize(
    ("target", "headers", "status", "settings"),
    [
        (CHAT, b"content-type: application/json\r\n", 401, {"api_key": "sk-right"}),
        ("/v1/../admin", b"", 404, {}),
        (CHAT, b"content-type: text/plain\r\n", 415, {}),
        (CHAT, b"content-type: application/json\r\nx-request-class: nope\r\n", 400, {}),
    ],
    ids=["401", "404", "415", "400"],
)
def test_a_refusal_before_the_body_closes_and_the_body_is_never_a_next_request(
    make_shim: Callable[..., Any],
    recording: RecordingUpstream,
    target: str,
    headers: bytes,
    status: int,
    settings: dict[str, Any],
) -> None:
    shim = make_shim(recording.url, tuning=Tuning(header_read_timeout=0.5, max_header_bytes=4096), **settings)
    body = b'{"model": "m", "prompt": "' + b"x" * 20_000 + b'"}'  # no blank line in it, past the cap
    head = b"POST %b HTTP/1.1\r\nhost: x\r\n%bcontent-length: %d\r\n\r\n" % (
        target.encode(),
        headers,
        len(body),
    )
    with connect(shim) as sock:
        sock.sendall(head)
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        closing = b"\r\nconnection: close\r\n" in received.split(b"\r\n\r\n", 1)[0].lower() + b"\r\n"
        # The fast path closes after such an answer; the public path reads the body past and
        # serves on: then a next request on the same connection must be answered as one.
        after = b"" if closing else b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        with contextlib.suppress(OSError):
            sock.sendall(body + after)  # the body after the answer: the shim has closed, or reads it past
        received += read_until_closed(sock)
    answers = split_answers(received)
    # No 408 or 431 later: the body was never taken for a head.
    assert [code for code, _, _ in answers] == ([status] if closing else [status, 200])
    counts = bad_requests(shim)
    assert counts["header_timeout"] == 0
    assert counts["headers_too_large"] == 0
    assert recording.requests == []
    serves(shim, recording)


# -- request lines and Host ------------------------------------------------------------------


@pytest.mark.parametrize(
    "head",
    [
        b"GET /v1/models\nX-Inj: 1 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /v1/models\nX-Inj: 1 HTTP/1.1\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nX-A: 1\r\n\r\n",
        b"GET /v1/models HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET /health\nX-Inj: 1 HTTP/1.1\r\n\r\n",
    ],
    ids=[
        "bare LF in request line",
        "bare LF, no host",
        "duplicate host",
        "no host on 1.1",
        "duplicate host on 1.0",
        "duplicate host, not /v1/",
        "bare LF, not /v1/",
    ],
)
def test_ambiguous_request_lines_and_hosts_get_400_and_are_never_forwarded(
    make_shim: Callable[..., Any], recording: RecordingUpstream, head: bytes
) -> None:
    shim = make_shim(recording.url)
    with connect(shim) as sock:
        sock.sendall(head)
        ((status, headers, body),) = split_answers(read_until_closed(sock))
    assert status == 400
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "malformed_http"
    assert bad_requests(shim)["malformed_http"] == 1
    assert recording.requests == []
    serves(shim, recording)


def test_http_1_0_without_host_is_still_served(
    make_shim: Callable[..., Any], recording: RecordingUpstream
) -> None:
    shim = make_shim(recording.url)
    with connect(shim) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        ((status, _, _),) = split_answers(read_until_closed(sock))
    assert status == 200
    assert len(recording.requests) == 1


# -- the upstream's response head ------------------------------------------------------------


@pytest.mark.parametrize("what", ["big-head", "many-headers", "endless-head"])
def test_an_oversized_upstream_head_is_a_502_never_relayed_and_the_slot_comes_back(
    make_shim: Callable[..., Any], recording: RecordingUpstream, what: str, waiter: Callable[..., None]
) -> None:
    shim = make_shim(recording.url, max_concurrency=1)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-rec: %b\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%b" % (what.encode(), len(GOOD), GOOD)
    )
    with connect(shim) as sock:
        sock.sendall(head)
        received = read_until_closed(sock)
    ((status, headers, body),) = split_answers(received)
    assert status == 502
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("server_error", "bad_upstream_response")
    assert len(received) < 2000  # nothing of the upstream's head came through
    assert not any(
        name.startswith("x-") and name not in ("x-queue-time-ms", "x-llm-backoff-refusal") for name in headers
    )
    assert headers["x-llm-backoff-refusal"] == "retry-bad-upstream-response"
    if what == "endless-head":
        waiter(lambda: recording.endless_cut, what="the shim to cut the endless head")
        assert recording.endless_sent < 64 << 20  # read up to the limit, then the connection dropped
    assert shim.state()["interactive"] == (0, 0)
    samples = shim.metrics()
    key = (
        "llm_backoff_shim_requests_total",
        (("class", "interactive"), ("code", ""), ("outcome", "upstream_error")),
    )
    assert samples[key] == 1
    serves(shim, recording)


# -- forwarding headers ----------------------------------------------------------------------


def forwarded_headers(request: bytes) -> list[tuple[str, str]]:
    lines = request.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
    names = ("x-forwarded-for", "forwarded", "x-real-ip", "x-forwarded-host", "x-forwarded-proto")
    pairs = [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]
    return [(k, v) for k, v in pairs if k in names]


SPOOFED = (
    b"x-forwarded-for: 1.2.3.4\r\nX-Forwarded-For: 5.6.7.8\r\nforwarded: for=1.2.3.4;proto=https\r\n"
    b"x-real-ip: 1.2.3.4\r\nx-forwarded-host: evil.example\r\nx-forwarded-proto: https\r\n"
)


def test_a_clients_forwarding_headers_are_replaced_by_its_real_address(
    make_shim: Callable[..., Any], recording: RecordingUpstream
) -> None:
    shim = make_shim(recording.url)
    with connect(shim) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + SPOOFED + b"connection: close\r\n\r\n")
        ((status, _, _),) = split_answers(read_until_closed(sock))
    assert status == 200
    (request,) = recording.requests
    assert b"1.2.3.4" not in request
    assert b"5.6.7.8" not in request
    assert b"evil.example" not in request
    assert forwarded_headers(request) == [
        ("x-forwarded-for", "127.0.0.1"),
        ("x-real-ip", "127.0.0.1"),
        ("forwarded", "for=127.0.0.1"),
    ]


def test_a_trusted_proxys_chain_is_kept_and_the_peer_appended(
    make_shim: Callable[..., Any], recording: RecordingUpstream
) -> None:
    shim = make_shim(recording.url, trusted_proxies="10.0.0.0/8, 127.0.0.1")
    for extra, chain in [
        # The load balancer's chain: the client said 1.2.3.4, the balancer saw 203.0.113.9.
        (b"x-forwarded-for: 1.2.3.4, 203.0.113.9\r\nx-forwarded-proto: https\r\n", "1.2.3.4, 203.0.113.9"),
        (b"forwarded: for=203.0.113.9;proto=https, for=10.1.2.3\r\n", "203.0.113.9, 10.1.2.3"),
        (b"", ""),
    ]:
        with connect(shim) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + extra + b"connection: close\r\n\r\n")
            ((status, _, _),) = split_answers(read_until_closed(sock))
        assert status == 200
        full = f"{chain}, 127.0.0.1" if chain else "127.0.0.1"
        hops = full.split(", ")
        got = dict(forwarded_headers(recording.requests[-1]))
        assert got["x-forwarded-for"] == full
        assert got["forwarded"] == ", ".join(f"for={hop}" for hop in hops)
        # The last hop that is not a trusted proxy is the client.
        assert got["x-real-ip"] == ("203.0.113.9" if chain else "127.0.0.1")
        assert got.get("x-forwarded-proto") == ("https" if b"x-forwarded-proto" in extra else None)


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    from llm_backoff_shim.serve.config.sources import load_settings
    from llm_backoff_shim.serve.config.values import ConfigError

    assert load_settings(["--trusted-proxies", "10.0.0.0/8,::1"]).trusted_proxies == ("10.0.0.0/8", "::1")
    with pytest.raises(ConfigError, match="not an IP address"):
        load_settings(["--trusted-proxies", "10.0.0.0/8,lb.example"])


# -- a stream that stalls --------------------------------------------------------------------


def test_a_stalled_stream_is_cut_after_the_stream_timeout_and_its_slot_comes_back(
    make_shim: Callable[..., Any], recording: RecordingUpstream, waiter: Callable[..., None]
) -> None:
    shim = make_shim(recording.url, max_concurrency=1, tuning=Tuning(upstream_stream_read_timeout=0.5))
    body = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-rec: stall\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
    )
    with connect(shim) as sock:
        sock.sendall(head)
        received = read_until_closed(sock)  # the shim ends it: the socket's 20 s bound a broken test
    head_part, _, chunks = received.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 200")
    events = [line for line in chunks.split(b"\n") if line.startswith(b"data: ")]
    assert events[0] == b'data: {"i": 0}'
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_timeout")
    assert not chunks.endswith(b"0\r\n\r\n")  # cut, never passed off as a complete stream
    waiter(lambda: recording.closed_streams == 1, what="the upstream connection closed")
    assert shim.state()["interactive"] == (0, 0)
    with connect(shim) as sock:  # the only slot serves the next request
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(GOOD), GOOD)
        )
        ((status, _, _),) = split_answers(read_until_closed(sock))
    assert status == 200


def test_a_non_streaming_answer_keeps_the_long_read_timeout(
    make_shim: Callable[..., Any], recording: RecordingUpstream, waiter: Callable[..., None]
) -> None:
    """Silence longer than the stream timeout before a plain answer is a long generation, not a stall."""
    shim = make_shim(recording.url, upstream_read_timeout=60, tuning=Tuning(upstream_stream_read_timeout=0.2))
    with connect(shim) as sock:
        sock.sendall(b"GET /v1/hold/x HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        waiter(lambda: len(recording.requests) == 1, what="the request upstream")
        threading.Timer(1.0, recording.release).start()  # five stream timeouts of silence
        ((status, _, body),) = split_answers(read_until_closed(sock))
    assert (status, body) == (200, b'{"ok":true}')
