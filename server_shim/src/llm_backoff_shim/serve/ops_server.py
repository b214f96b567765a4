"""The operations listener: ``/metrics``, ``/health`` and ``/shim/state`` on their own address.

With ``--metrics-port`` (and optionally ``--metrics-host``, e.g. a private interface
while the proxy listens publicly) these are served by a small threaded WSGI server
(the standard library's, as ``prometheus_client.start_http_server`` uses) in a daemon
thread, so scrapes never compete with proxied traffic on the event loop, and the
proxy's own listener does not answer ``/metrics`` or ``/shim/state``.
``/health`` says the process is up; ``/ready`` (which probes the upstream) stays on the
proxy listener, where load balancers look for it.

The live numbers are read from the admission controller from this thread without a
lock: they are plain integer reads, as the Prometheus collector already does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from llm_backoff_shim.serve.app import ShimRuntime

StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


def _json(start_response: StartResponse, status: str, data: object) -> Iterable[bytes]:
    body = json.dumps(data).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def ops_wsgi_app(runtime: ShimRuntime) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    metrics_app = make_wsgi_app(runtime.metrics.registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _json(start_response, "405 Method Not Allowed", {"error": {"message": "GET only"}})
        if path == "/metrics":
            result: Iterable[bytes] = metrics_app(environ, start_response)
            return result
        if path == "/health":
            return _json(start_response, "200 OK", {"status": "ok"})
        if path == "/shim/state":
            return _json(start_response, "200 OK", runtime.state_document())
        return _json(
            start_response,
            "404 Not Found",
            {"error": {"message": "this listener serves /metrics, /health and /shim/state", "code": None}},
        )

    return app


class OpsServer:
    """The listener in a daemon thread; ``stop()`` closes it (tests, clean shutdown)."""

    def __init__(self, runtime: ShimRuntime, host: str, port: int) -> None:
        self._server = make_server(
            host, port, ops_wsgi_app(runtime), server_class=_ThreadingServer, handler_class=_QuietHandler
        )
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"ops:{self.port}", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> OpsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
