"""``llm-backoff-shim serve``: parse settings, build the app, run uvicorn.

uvicorn runs without its own ``server``/``date`` headers (the upstream's come through
and must not be duplicated), on uvloop and httptools when installed. The optional
``--metrics-port`` is served by prometheus_client's own small HTTP server thread,
so scrapes never compete with proxied traffic on the event loop.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import uvicorn
from prometheus_client import start_http_server

from llm_backoff_shim.app import create_app, shim_state
from llm_backoff_shim.config import ConfigError, ShimSettings, load_settings


def uvicorn_options(settings: ShimSettings) -> dict[str, Any]:
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "server_header": False,
        "date_header": False,
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
        "lifespan": "on",
        # Streams of a minute or more are normal; do not let shutdown cut them at once.
        "timeout_graceful_shutdown": 30,
    }


def main(argv: list[str]) -> int:
    prog = "llm-backoff-shim serve"
    try:
        settings = load_settings(argv, prog=prog)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings)
    if settings.metrics_port is not None:
        try:
            start_http_server(
                settings.metrics_port, addr=settings.host, registry=shim_state(app).metrics.registry
            )
        except OSError as exc:
            print(f"{prog}: cannot serve metrics on port {settings.metrics_port}: {exc}", file=sys.stderr)
            return 2
    try:
        uvicorn.run(app, **uvicorn_options(settings))
    except OSError as exc:
        print(f"{prog}: cannot serve on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 2
    return 0
