"""Assembles the shim: settings -> admission, estimator, metrics, upstream client, routes.

``create_app(settings)`` returns a Starlette app whose lifespan opens and closes the
upstream session. Routes: ``GET /health`` (the shim is up), ``GET /ready`` (the
upstream answers its ready path), ``GET /metrics`` (Prometheus text),
``GET /shim/state`` (live in-flight/queued per class, JSON, for the demo and
operators); every other path goes to the proxy, which serves the engine's routes as the
route table (routes.py) says and answers the rest with an OpenAI-format 404. The shim's own
four routes win over the engine's of the same name.

Tests and the demo read live state in-process with :func:`shim_state`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.classes import ClassShares, SharedSlots
from llm_backoff_shim.decide.drain_estimate import DrainEstimator, EstimatorConfig
from llm_backoff_shim.decide.limit import ConcurrencyLimit
from llm_backoff_shim.decide.requests import ClassPolicy
from llm_backoff_shim.serve.access_log import AccessLog
from llm_backoff_shim.serve.config import ShimSettings
from llm_backoff_shim.serve.headers import Forwarding
from llm_backoff_shim.serve.metrics import CONTENT_TYPE, ShimMetrics
from llm_backoff_shim.serve.proxy import Proxy
from llm_backoff_shim.serve.rejection import client_error
from llm_backoff_shim.serve.routes import ROUTES, RouteTable
from llm_backoff_shim.serve.traffic_policy import TrafficPolicy, build_traffic_policy, concurrency_limit
from llm_backoff_shim.serve.upstream import UpstreamClient
from llm_backoff_shim.serve.waiting import AsyncAdmission

Clock = Callable[[], float]


@dataclass(frozen=True)
class ClassState:
    in_flight: int
    queued: int


@dataclass
class ShimRuntime:
    """Everything one shim app owns; reachable as ``app.state.shim``."""

    settings: ShimSettings
    controller: AdmissionController
    admission: AsyncAdmission
    metrics: ShimMetrics
    upstream: UpstreamClient
    proxy: Proxy
    policy: TrafficPolicy | None = None

    def snapshot(self) -> dict[str, ClassState]:
        c = self.controller
        return {cls: ClassState(in_flight=c.in_flight(cls), queued=c.queued(cls)) for cls in c.classes}

    def state_document(self) -> dict[str, Any]:
        """``GET /shim/state``, on whichever listener serves it."""
        c = self.controller
        return {
            "limit": c.limit,
            "service_time_s": c.estimator.service_time,
            # Queued requests turned away after the estimate moved (admission's safety net).
            "overtaken": c.overtaken_total,
            "classes": {
                cls: {"in_flight": s.in_flight, "queued": s.queued} for cls, s in self.snapshot().items()
            },
        }


def build_controller(
    settings: ShimSettings, clock: Clock, limit: ConcurrencyLimit | None = None
) -> AdmissionController:
    estimator = DrainEstimator(
        EstimatorConfig(
            retry_after_min=settings.retry_after_min,
            retry_after_max=settings.retry_after_max,
            initial_service_time=settings.initial_service_time,
        ),
        clock,
    )
    policies = [
        ClassPolicy(
            name=name,
            max_queue=limits.max_queue,
            # A request queued for its whole time-to-first-token budget has missed it already.
            max_queue_wait=min(limits.max_queue_wait, settings.ttft_slo.get(name, math.inf)),
        )
        for name, limits in settings.class_limits().items()
    ]
    return AdmissionController(
        policies,
        limit=limit if limit is not None else concurrency_limit(settings, clock),
        estimator=estimator,
        clock=clock,
        max_queue_total=settings.max_queue,
        default_class=settings.default_class,
        scheduler=SharedSlots(ClassShares(reserved=settings.reserved_share, minimum=settings.min_share)),
        returning_first=settings.returning_first,
        returning_share=settings.returning_share,
    )


def create_app(settings: ShimSettings, *, clock: Clock = time.monotonic) -> Starlette:
    limit = concurrency_limit(settings, clock)
    controller = build_controller(settings, clock, limit)
    admission = AsyncAdmission(controller, clock)
    upstream = UpstreamClient(
        settings.upstream_base,
        connect_timeout=settings.upstream_connect_timeout,
        read_timeout=settings.upstream_read_timeout,
        keepalive=settings.upstream_keepalive,
        stream_read_timeout=settings.upstream_stream_read_timeout,
    )
    policy = build_traffic_policy(settings, controller, admission, upstream, clock, limit=limit)
    metrics = ShimMetrics(controller, slo_state=policy.slo_state)
    metrics.registry.register(policy.collector())
    proxy = Proxy(
        upstream=upstream,
        admission=admission,
        metrics=metrics,
        reject_status=settings.reject_status,
        clock=clock,
        api_keys=settings.api_keys(),
        max_body_bytes=settings.max_body_bytes,
        body_timeout=settings.body_read_timeout,
        hooks=policy.hooks,
        on_first_byte=policy.on_first_byte,
        access_log=AccessLog(settings.log_format, clock=clock) if settings.access_log else None,
        routes=RouteTable(settings.allow_operator_route),
        forwarding=Forwarding(settings.trusted_proxies),
    )
    runtime = ShimRuntime(settings, controller, admission, metrics, upstream, proxy, policy)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        ok, reason = await upstream.ready(settings.ready_path)
        return JSONResponse(
            {"status": "ready" if ok else "unavailable", "detail": reason}, 200 if ok else 503
        )

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def state(request: Request) -> Response:
        return JSONResponse(runtime.state_document())

    async def not_found(request: Request, exc: Exception) -> Response:
        # Paths no route pattern can match (a decoded CR/LF) reach Starlette's own plain 404.
        metrics.bad_request("bad_path")
        answer = client_error("no such path: the shim serves the engine's API (docs/shim.md)", status=404)
        return Response(answer.body, status_code=404, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await upstream.open()
        policy.start()
        try:
            yield
        finally:
            await policy.stop()
            await upstream.close()

    app = _ShimApp(
        proxy,
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            # With --metrics-port these two live only on the separate listener (see ops_server).
            *(
                [
                    Route("/metrics", metrics_endpoint, methods=["GET"]),
                    Route("/shim/state", state, methods=["GET"]),
                ]
                if settings.metrics_port is None
                else []
            ),
            # Proxy is a class instance, so Starlette hands it the raw ASGI call (all methods).
            Route("/{path:path}", proxy),
        ],
        lifespan=lifespan,
        exception_handlers={404: not_found},
    )
    app.state.shim = runtime
    return app


#: Route-table paths outside ``/v1/`` that go straight to the proxy (none is one of the shim's own).
_DIRECT: frozenset[str] = frozenset(r.path for r in ROUTES if not r.path.startswith("/v1/"))


class _ShimApp(Starlette):
    """Starlette for the control routes; the engine's routes go straight to the proxy.

    The proxy answers its own errors, so on the relay path Starlette's router and
    middleware (error and exception wrappers around every ``send``) would only cost
    CPU (bench/bench_proxy.py). A path with a newline still goes through Starlette,
    where no route matches it.
    """

    def __init__(self, proxy: Proxy, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if (path.startswith("/v1/") and "\n" not in path) or path in _DIRECT:
                await self._proxy(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def shim_state(app: Starlette) -> ShimRuntime:
    """The live runtime of an app made by :func:`create_app`."""
    runtime = app.state.shim
    assert isinstance(runtime, ShimRuntime)
    return runtime
