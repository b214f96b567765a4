"""The shim's ASGI app: its own routes, and the proxy for everything else.

Routes: ``GET /health`` (the shim is up), ``GET /ready`` (the upstream answers its
ready path), ``GET /metrics`` (Prometheus text), ``GET /shim/state`` (live
in-flight/queued per class, JSON, for the demo and operators); every other path goes to
the proxy, which serves the engine's routes as the route table (routes.py) says and
answers the rest with an OpenAI-format 404. The shim's own four routes win over the
engine's of the same name. The operations listener (ops_server.py) serves the same
``/metrics``, ``/health`` and ``/shim/state`` handlers on its own address.

Everything here is handed already built (app.py, the composition root, builds it);
tests and the demo read live state in-process with :func:`shim_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Lifespan, Receive, Scope, Send

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.serve.api.rejection import client_error
from llm_backoff_shim.serve.api.routes import ROUTES
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.tuning import Tuning
from llm_backoff_shim.serve.observe.metrics import CONTENT_TYPE, ShimMetrics
from llm_backoff_shim.serve.ops_server import OpsListener
from llm_backoff_shim.serve.policy.traffic_policy import TrafficPolicy
from llm_backoff_shim.serve.request_path.proxy import Proxy
from llm_backoff_shim.serve.request_path.upstream import UpstreamClient
from llm_backoff_shim.serve.request_path.waiting import AsyncAdmission


@dataclass(frozen=True)
class ClassState:
    in_flight: int
    queued: int


@dataclass
class ShimRuntime:
    """Everything one shim app owns; reachable as ``app.state.shim``.

    ``settings`` and ``tuning`` are kept for whoever serves the app (the serving path and its
    limits, command.py); nothing below the composition root reads them.
    """

    settings: ShimSettings
    tuning: Tuning
    controller: AdmissionController
    admission: AsyncAdmission
    metrics: ShimMetrics
    upstream: UpstreamClient
    proxy: Proxy
    policy: TrafficPolicy | None = None
    #: The operations listener (``--metrics-port``), started and stopped by the app's lifespan.
    ops: OpsListener | None = None

    def snapshot(self) -> dict[str, ClassState]:
        c = self.controller
        return {cls: ClassState(in_flight=c.in_flight(cls), queued=c.queued(cls)) for cls in c.classes}

    def state_document(self) -> dict[str, Any]:
        """``GET /shim/state``, on whichever listener serves it."""
        return state_document(self.controller)


def state_document(controller: AdmissionController) -> dict[str, Any]:
    """``GET /shim/state``: the limit, the service-time estimate, in-flight and queued per class."""
    c = controller
    document: dict[str, Any] = {
        "limit": c.limit,
        "service_time_s": c.estimator.service_time,
        # Queued requests turned away after the estimate moved (admission's safety net).
        "overtaken": c.overtaken_total,
        "classes": {cls: {"in_flight": c.in_flight(cls), "queued": c.queued(cls)} for cls in c.classes},
    }
    if c.token_budget is not None:
        document["max_inflight_tokens"] = c.token_budget
        document["in_flight_tokens"] = c.in_flight_tokens()
    # This engine's answer lengths as learned (None: not enough answers yet).
    document["answer_tokens"] = {cls: c.answers.learned(cls) for cls in c.classes}
    if c.pricing is not None:
        # What the budget counts: prompts at the engine's bytes per token, answers as above.
        document["prompt_bytes_per_token"] = round(c.pricing.ratio, 3)
    if c.estimator.promises.fleet is not None:
        document["fleet_replicas"] = c.estimator.promises.replicas
    return document


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def operator_routes(metrics: ShimMetrics, controller: AdmissionController) -> list[Route]:
    """``/metrics`` and ``/shim/state``: on the proxy's listener, or on the operations listener."""

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def state(request: Request) -> Response:
        return JSONResponse(state_document(controller))

    return [
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/shim/state", state, methods=["GET"]),
    ]


def shim_app(
    runtime: ShimRuntime, *, ready_path: str, operator_routes_here: bool, lifespan: Lifespan[Any]
) -> Starlette:
    """The shim's ASGI app around ``runtime``; ``operator_routes_here`` False leaves
    ``/metrics`` and ``/shim/state`` to the operations listener."""
    upstream, metrics = runtime.upstream, runtime.metrics

    async def ready(request: Request) -> Response:
        ok, reason = await upstream.ready(ready_path)
        return JSONResponse(
            {"status": "ready" if ok else "unavailable", "detail": reason}, 200 if ok else 503
        )

    async def not_found(request: Request, exc: Exception) -> Response:
        # Paths no route pattern can match (a decoded CR/LF) reach Starlette's own plain 404.
        metrics.bad_request("bad_path")
        answer = client_error("no such path: the shim serves the engine's API (docs/shim.md)", status=404)
        return Response(answer.body, status_code=404, media_type="application/json")

    app = _ShimApp(
        runtime.proxy,
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            *(operator_routes(metrics, runtime.controller) if operator_routes_here else []),
            # Proxy is a class instance, so Starlette hands it the raw ASGI call (all methods).
            Route("/{path:path}", runtime.proxy),
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
    """The live runtime of an app made by :func:`~llm_backoff_shim.serve.app.create_app`."""
    runtime = app.state.shim
    assert isinstance(runtime, ShimRuntime)
    return runtime


__all__ = [
    "ClassState",
    "ShimRuntime",
    "health",
    "operator_routes",
    "shim_app",
    "shim_state",
    "state_document",
]
