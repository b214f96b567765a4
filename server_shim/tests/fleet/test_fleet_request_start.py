"""The shipped nginx and HAProxy configurations stamp each call once with ``X-Request-Start``:
every replica a call is tried at sees the same stamp, so each shim counts the caller's budget
from when the load balancer first saw it.

Three engines that always answer 503 (busy) record the stamp each try brought; a shim beside
each passes the 503 on as its refusal, and the load balancer tries the next replica. Bounded:
one call per load balancer, loopback only.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from llm_backoff_shim.lab.fleet import Fleet
from llm_backoff_shim.serve.request_path.intake import parse_request_start

pytestmark = pytest.mark.timeout(60)


class Busy(http.server.BaseHTTPRequestHandler):
    """An engine that is alive (``/health``) and refuses every call with 503, noting its stamp."""

    seen: list[str | None]

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.seen.append(self.headers.get("x-request-start"))
        body = b'{"error": {"message": "busy", "type": "server_error", "code": null}}'
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engines() -> Iterator[tuple[list[str], list[str | None]]]:
    seen: list[str | None] = []
    handler = type("Recording", (Busy,), {"seen": seen})
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(3)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers], seen
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("lb", ["nginx", "haproxy"])
def test_every_try_of_a_call_carries_the_load_balancers_first_stamp(
    lb: str, engines: tuple[list[str], list[str | None]], need: Callable[[str], None]
) -> None:
    need(lb)
    urls, seen = engines
    with Fleet(3, lb, upstreams=urls) as fleet:
        before = time.time()
        r = httpx.post(
            f"{fleet.url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        after = time.time()
    assert r.status_code in (429, 503), r.text
    assert len(seen) >= 3, seen  # every replica was tried
    assert len(set(seen)) == 1, seen  # one stamp for the call, on every try
    stamp = parse_request_start(seen[0])
    assert stamp is not None, seen
    assert before - 0.5 <= stamp <= after + 0.5, (before, stamp, after)
