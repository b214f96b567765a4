"""The composition root: the validated settings in, the whole shim out, built top-down.

``create_app(settings)`` reads :class:`~llm_backoff_shim.serve.config.ShimSettings` and the fixed
values of serve/config/tuning.py here and nowhere below: every piece is handed plain values, or
its own slice of the settings (serve/config/slices.py), and the pieces built before it.

0. what the settings derive (vLLM's priorities), and the upstream client, which depends on
   nothing built here;
1. decide/ (pure): the concurrency limit, the drain estimator, the class policies and
   their shares, the admission controller (:func:`build_decisions`), the SLO tracker
   (a gate on the controller, a hold on the scheduler), the tenant directory;
2. the edge, handed those: waiting (:class:`~llm_backoff_shim.serve.request_path.waiting.AsyncAdmission`),
   the filters (engine watch, tenant quotas, the request hooks) as one
   :class:`~llm_backoff_shim.serve.policy.traffic_policy.TrafficPolicy`, metrics, with
   ``--metrics-port`` the operations listener (ops_server.py), then the request path: the
   intake and the admission gate from their slices, the relay, and the proxy over them with
   the access log; last
   the ASGI app (shim_app.py), whose lifespan opens and closes them.

Tests and the demo read live state in-process with :func:`shim_state`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.routing import Route

from llm_backoff_shim.decide.adaptive_limit import GradientConfig, GradientLimit
from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.classes import ClassShares, SharedSlots
from llm_backoff_shim.decide.drain_estimate import DrainEstimator, EstimatorConfig
from llm_backoff_shim.decide.limit import ConcurrencyLimit, FixedLimit
from llm_backoff_shim.decide.requests import ClassPolicy
from llm_backoff_shim.decide.saturation import SaturationConfig, SaturationDetector
from llm_backoff_shim.decide.slo import SloConfig, SloGate, SloTracker
from llm_backoff_shim.decide.tenants import QuotaGate, TenantDirectory, load_tenants_file
from llm_backoff_shim.decide.token_budget import TokenBudget
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.tuning import TUNING, Tuning
from llm_backoff_shim.serve.observe.access_log import AccessLog
from llm_backoff_shim.serve.observe.metrics import ShimMetrics
from llm_backoff_shim.serve.ops_server import OpsListener
from llm_backoff_shim.serve.policy.engine_watch import EngineWatch
from llm_backoff_shim.serve.policy.prompt_units import PromptUnits
from llm_backoff_shim.serve.policy.quota import TenantQuotas
from llm_backoff_shim.serve.policy.request_hooks import RequestHooks, ShimPolicies
from llm_backoff_shim.serve.policy.traffic_policy import TrafficPolicy
from llm_backoff_shim.serve.request_path.gate import AdmissionGate
from llm_backoff_shim.serve.request_path.headers import Forwarding
from llm_backoff_shim.serve.request_path.intake import Intake
from llm_backoff_shim.serve.request_path.proxy import Proxy
from llm_backoff_shim.serve.request_path.relay import Relay
from llm_backoff_shim.serve.request_path.upstream import UpstreamClient
from llm_backoff_shim.serve.request_path.waiting import AsyncAdmission
from llm_backoff_shim.serve.shim_app import (
    ClassState,
    ShimRuntime,
    health,
    operator_routes,
    shim_app,
    shim_state,
)

Clock = Callable[[], float]


@dataclass(frozen=True)
class Decisions:
    """The decide/ pieces the edge is handed: the concurrency limit and the controller over it."""

    limit: ConcurrencyLimit
    controller: AdmissionController


def build_decisions(
    settings: ShimSettings, clock: Clock, limit: ConcurrencyLimit | None = None, tuning: Tuning = TUNING
) -> Decisions:
    """The concurrency limit (``limit`` if given) and the admission controller, without the SLO
    gate (:func:`create_app` adds it)."""
    class_limits = settings.class_limits()
    if limit is None:
        limit = (
            GradientLimit(
                GradientConfig(min_limit=tuning.min_concurrency, max_limit=settings.max_concurrency), clock
            )
            if settings.adaptive_concurrency
            else FixedLimit(settings.max_concurrency)
        )
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
        for name, limits in class_limits.items()
    ]
    controller = AdmissionController(
        policies,
        limit=limit,
        estimator=estimator,
        clock=clock,
        max_queue_total=settings.max_queue,
        default_class=settings.default_class,
        scheduler=SharedSlots(ClassShares(reserved=settings.reserved_share, minimum=settings.min_share)),
        returning_first=settings.returning_first,
        returning_share=tuning.returning_share,
        token_budget=None if (tokens := settings.max_inflight_tokens) is None else TokenBudget(tokens),
    )
    return Decisions(limit, controller)


def build_controller(
    settings: ShimSettings, clock: Clock, limit: ConcurrencyLimit | None = None, tuning: Tuning = TUNING
) -> AdmissionController:
    """The admission controller the shim serves with, for the lab's overload model and the
    property tests (:func:`build_decisions`)."""
    return build_decisions(settings, clock, limit, tuning).controller


def create_app(
    settings: ShimSettings, *, clock: Clock = time.monotonic, tuning: Tuning = TUNING
) -> Starlette:
    """The shim for ``settings`` and the fixed values ``tuning`` (config/tuning.py): decide pieces
    first, then the edge handed them (module docstring)."""
    # What the settings derive (vLLM's priorities), read once.
    vllm_priority = settings.vllm_priority() if settings.forward_priority else None
    tenant_rates = (settings.tenant_requests_per_minute, settings.tenant_tokens_per_minute)
    limited_by_flags = any(rate is not None and math.isfinite(rate) for rate in tenant_rates)
    # The upstream client depends on nothing built here (its URL is parsed as it is made).
    upstream = UpstreamClient(
        settings.upstream_base,
        connect_timeout=tuning.upstream_connect_timeout,
        read_timeout=settings.upstream_read_timeout,
        keepalive=tuning.upstream_keepalive,
        stream_read_timeout=tuning.upstream_stream_read_timeout,
    )

    # -- decide/: pure pieces from plain values --------------------------------------------
    decisions = build_decisions(settings, clock, tuning=tuning)
    limit, controller = decisions.limit, decisions.controller
    scheduler = controller.scheduler
    slo = None
    if settings.ttft_slo:
        slo = SloTracker(
            SloConfig(
                budgets=settings.ttft_slo,
                yellow_fraction=tuning.slo_yellow_fraction,
                trend_window=tuning.slo_trend_window,
            ),
            controller,
            clock,
        )
        controller.gates.append(SloGate(slo))
        if isinstance(scheduler, SharedSlots):
            scheduler.add_hold(slo.holds)
    tenants_file = None
    if settings.tenants_file is not None:
        tenants_file = load_tenants_file(settings.tenants_file, settings.classes)
    # Every request names its tenant (its API key's hash, or --tenant-header's value), file or
    # not: tenants take turns within a class (decide/queues.py).
    directory = TenantDirectory(
        tenants_file,
        header=settings.tenant_header,
        requests_per_minute=settings.tenant_requests_per_minute,
        tokens_per_minute=settings.tenant_tokens_per_minute,
    )

    # -- the edge, handed the pieces above -------------------------------------------------
    admission = AsyncAdmission(controller, clock)
    policy = TrafficPolicy(limit=limit, hooks=RequestHooks(), slo=slo, reschedule=admission.reschedule)
    if settings.engine_metrics:
        policy.detector = SaturationDetector(
            SaturationConfig(
                max_waiting=tuning.engine_max_waiting,
                max_kv_cache=tuning.engine_max_kv_cache,
                stale_after=tuning.engine_stale_after,
            ),
            clock,
            in_flight=controller.in_flight,
        )
        policy.watch = EngineWatch(
            policy.detector,
            url=settings.upstream_base + tuning.engine_metrics_path,
            session=lambda: upstream.session,
            interval=tuning.engine_poll_interval,
            on_change=admission.reschedule,
        )
    named = tenants_file is not None or settings.tenant_header is not None or limited_by_flags
    if named and directory.limited:
        policy.quotas = TenantQuotas(clock=clock, redis_url=settings.redis_url)
        # First of the gates: a request over its quota is refused whatever the load.
        controller.gates.insert(0, QuotaGate(controller.estimator.config.retry_after_min))
    policy.hooks = ShimPolicies(
        controller, directory=directory, quotas=policy.quotas, slo=slo, vllm_priority=vllm_priority
    )
    metrics = ShimMetrics(controller, slo_state=policy.slo_state)
    metrics.registry.register(policy.collector())
    ops = None
    if settings.metrics_port is not None:
        ops = OpsListener(
            [Route("/health", health, methods=["GET"]), *operator_routes(metrics, controller)],
            settings.host,
            settings.metrics_port,
            head_timeout=tuning.header_read_timeout,
            max_head_bytes=tuning.max_header_bytes,
            on_event=metrics.bad_request,
        )
    intake = Intake.from_settings(settings.intake_settings(), hooks=policy.hooks, controller=controller)
    gate = AdmissionGate.from_settings(
        settings.gate_settings(),
        admission=admission,
        metrics=metrics,
        clock=clock,
        hooks=policy.hooks,
        on_first_byte=policy.on_first_byte,
    )
    relay = Relay(
        upstream=upstream,
        metrics=metrics,
        clock=clock,
        on_upstream_answer=gate.upstream_answered,
    )
    proxy = Proxy(
        intake=intake,
        gate=gate,
        relay=relay,
        metrics=metrics,
        clock=clock,
        access_log=AccessLog(settings.log_format, clock=clock) if settings.access_log else None,
        forwarding=Forwarding(settings.trusted_proxies),
    )
    runtime = ShimRuntime(settings, tuning, controller, admission, metrics, upstream, proxy, policy, ops)
    # The cost budget counts prompts in the engine's tokens, learned from its tokenizer.
    units = None
    if controller.pricing is not None:
        units = PromptUnits(
            controller.pricing, url=settings.upstream_base + "/tokenize", session=lambda: upstream.session
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await upstream.open()
        policy.start()
        if units is not None:
            units.start()
        if ops is not None:
            await ops.start()
        try:
            yield
        finally:
            if ops is not None:
                await ops.stop()
            if units is not None:
                await units.stop()
            await policy.stop()
            await upstream.close()
            await gate.close()

    app = shim_app(runtime, ready_path=tuning.ready_path, operator_routes_here=ops is None, lifespan=lifespan)
    # Last, the engine watch's hold on the scheduler: lower classes wait while the engine is saturated.
    if policy.detector is not None and isinstance(scheduler, SharedSlots):
        scheduler.add_hold(policy.detector.hold)
    return app


__all__ = [
    "ClassState",
    "Decisions",
    "ShimRuntime",
    "build_controller",
    "build_decisions",
    "create_app",
    "shim_state",
]
