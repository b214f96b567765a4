"""bench/_wire.py: the time to rejection on the wire, from kernel-timestamped loopback segments."""

from __future__ import annotations

import http.client
import http.server
import importlib.util
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest


def load_wire() -> ModuleType:
    path = Path(__file__).resolve().parents[3] / "bench" / "_wire.py"
    spec = importlib.util.spec_from_file_location("bench_wire", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_wire"] = module
    spec.loader.exec_module(module)
    return module


wire = load_wire()


class SlowRefusal(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        time.sleep(0.02)  # the answer leaves 20 ms after the request's last byte, at least
        body = b'{"error": {"code": "queue_full"}}'
        self.send_response(429)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.skipif(wire.capture_unavailable() is not None, reason="needs Linux and root")
def test_each_answer_is_timed_from_its_requests_last_byte_by_request_id() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowRefusal)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with wire.WireCapture(port) as capture:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            for attempt in range(1, 4):
                connection.request("POST", "/v1/x", body=b"{}" * 50, headers={"x-request-id": f"7-{attempt}"})
                response = connection.getresponse()
                response.read()
                assert response.status == 429
            connection.close()
    finally:
        server.shutdown()
    exchanges = capture.exchanges()
    assert [e.request_id for e in exchanges] == ["7-1", "7-2", "7-3"]
    assert all(e.status == 429 for e in exchanges)
    assert all(0.02 <= e.seconds < 2.0 for e in exchanges)


def test_only_tcp_segments_with_data_count() -> None:
    assert wire._tcp_payload(b"\x00" * 12 + b"\x86\xdd" + b"\x00" * 60) is None  # IPv6
    ip = bytes([0x45, 0, 0, 40]) + bytes(5) + bytes([6]) + bytes(10)
    tcp = (5555).to_bytes(2, "big") + (8080).to_bytes(2, "big") + bytes(8) + bytes([0x50]) + bytes(7)
    assert wire._tcp_payload(b"\x00" * 12 + b"\x08\x00" + ip + tcp) is None  # an ACK: no data
    assert wire._request_id(b"POST /v1/x HTTP/1.1\r\nHost: a\r\nX-Request-Id: 3-2\r\n\r\n") == "3-2"
    assert wire._request_id(b'{"messages": []}') is None  # a body segment, not a head
