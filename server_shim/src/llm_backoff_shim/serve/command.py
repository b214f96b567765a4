"""``llm-backoff-shim serve``: parse settings, build the app, run uvicorn.

uvicorn runs without its own ``server``/``date`` headers (the upstream's come through
and must not be duplicated), on uvloop when installed, on the serving path the
settings ask for (``--http-path``; :mod:`llm_backoff_shim.http.paths`): the fast path
when the start-up check passes, else the public path, both with the same request-head
limits and answers. It runs as one process (uvicorn's ``workers`` is 1 whatever
``WEB_CONCURRENCY`` says): the admission state is the process's, so one shim process
serves one engine. The optional ``--metrics-port`` (on ``--host``) is served
by :class:`~llm_backoff_shim.serve.ops_server.OpsListener` on the same event loop; its
address is taken before uvicorn starts, so a taken port is a clear error.
"""

from __future__ import annotations

import gc
import importlib.util
import logging.config
import os
import sys
from typing import Any

import uvicorn
from starlette.applications import Starlette

from llm_backoff_shim.http.limits import Limits
from llm_backoff_shim.http.paths import FastPathUnavailable, Serving, serving
from llm_backoff_shim.serve.app import create_app, shim_state
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.serve.config.values import ConfigError
from llm_backoff_shim.serve.log_setup import logging_config
from llm_backoff_shim.serve.startup import (
    listen_url,
    probe_upstream,
    several_workers_warning,
    startup_line,
    unknown_environment,
)

log = logging.getLogger("llm_backoff_shim.serve")


def uvicorn_options(settings: ShimSettings) -> dict[str, Any]:
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        # The shim's one line per request (access_log) replaces uvicorn's access log.
        "log_config": logging_config(settings.log_format, settings.log_level),
        "access_log": False,
        # The shim is the first hop: its access log records the peer, on every route alike
        # (uvicorn's default trusts X-Forwarded-For from 127.0.0.1; the fast path bypasses it).
        "proxy_headers": False,
        "server_header": False,
        "date_header": False,
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "lifespan": "on",
        # Streams of a minute or more are normal; do not let shutdown cut them at once.
        "timeout_graceful_shutdown": 30,
        # One process per engine: admission state (slots, queues, estimates) lives in the
        # process, so N workers would each admit --max-concurrency. Explicit, so uvicorn
        # does not read WEB_CONCURRENCY (startup.several_workers_warning says why it is ignored).
        "workers": 1,
    }


def shim_serving(app: Starlette) -> Serving:
    """The ASGI app and uvicorn options that serve a shim app (:func:`create_app`) as ``serve`` does."""
    runtime = shim_state(app)
    settings, tuning = runtime.settings, runtime.tuning
    proxy = runtime.proxy
    limits = Limits(
        head_timeout=tuning.header_read_timeout,
        max_head_bytes=tuning.max_header_bytes,
        body_timeout=settings.body_read_timeout,
        on_event=runtime.metrics.bad_request,
    )
    return serving(
        app,
        proxy,
        limits,
        requested=settings.http_path,
        refuse=proxy.refuse_from_head if tuning.refuse_from_head else None,
        body_timers=proxy.body_timers,
    )


#: Allocations between young-generation collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> None:
    """Fewer cyclic-GC passes over objects that cannot be garbage.

    Each relayed request allocates a few hundred short-lived container objects (ASGI
    messages, coroutines, futures), nearly all freed by reference counting. With the
    default threshold of 700 a young-generation pass ran every request or two and the
    GC took about 7 % of the shim's CPU under load (py-spy, bench/bench_proxy.py). A
    pass costs about as much whatever the threshold, since what it walks is the live
    young set (bounded by the requests in flight), so a higher threshold cuts the cost
    nearly in proportion. ``gc.freeze()`` moves everything built at start-up (modules,
    settings, the app) out of the generations the collector walks.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def main(argv: list[str]) -> int:
    prog = "llm-backoff-shim serve"
    try:
        settings = load_settings(argv, prog=prog)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings)
    ops = shim_state(app).ops
    if ops is not None:
        try:
            ops.bind()  # served from the app's lifespan, on the proxy's event loop
        except OSError as exc:
            print(f"{prog}: cannot serve metrics on {ops.host}:{ops.port}: {exc}", file=sys.stderr)
            return 2
    options = uvicorn_options(settings)
    # Before the serving path is chosen: its fallback warning is logged in the configured format.
    logging.config.dictConfig(options["log_config"])
    try:
        served = shim_serving(app)
    except FastPathUnavailable as exc:
        print(f"{prog}: {exc} (--http-path auto or public serves without it)", file=sys.stderr)
        return 2
    for message in unknown_environment(os.environ):
        log.warning("%s", message)
    workers = several_workers_warning(os.environ)
    if workers is not None:
        log.warning("%s", workers)
    if log.isEnabledFor(logging.INFO):  # below --log-level info the line, and so the probe, is skipped
        metrics = f"{ops.url if ops is not None else listen_url(settings.host, settings.port)}/metrics"
        upstream = probe_upstream(settings.upstream_base)
        log.info("%s", startup_line(settings, path=served.path, metrics_url=metrics, upstream=upstream))
    tune_gc()
    try:
        uvicorn.run(served.app, **{**options, **served.options})
    except OSError as exc:
        print(f"{prog}: cannot serve on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 2
    return 0
