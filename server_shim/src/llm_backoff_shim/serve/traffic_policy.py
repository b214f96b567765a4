"""Assembles the traffic policies from the settings and plugs them into the shim core.

- the concurrency limit: fixed ``--max-concurrency``, or the gradient limit
  (``--adaptive-concurrency``) fed with time-to-first-byte samples by the relay;
- the SLO tracker: a gate on the controller (RED / YELLOW shedding), a hold on the
  scheduler (lower classes wait while a higher one is YELLOW or RED), the
  ``slo_state`` gauge and the ``x-slo-state`` header;
- the engine watch: a hold on the scheduler while the engine is saturated and a task
  that scrapes the upstream's metrics;
- the request hooks (:class:`~llm_backoff_shim.serve.request_hooks.ShimPolicies`): classes
  by tenant, tenant quotas (local or Redis), vLLM priority.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llm_backoff_shim.decide.adaptive_limit import GradientConfig, GradientLimit
from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.classes import SharedSlots
from llm_backoff_shim.decide.limit import ConcurrencyLimit, FixedLimit
from llm_backoff_shim.decide.slo import SloConfig, SloGate, SloTracker
from llm_backoff_shim.decide.tenants import TenantDirectory, load_tenants_file
from llm_backoff_shim.serve.config import ShimSettings
from llm_backoff_shim.serve.engine_watch import (
    EngineWatch,
    SaturationConfig,
    SaturationDetector,
    engine_metric_gauges,
)
from llm_backoff_shim.serve.metrics import PREFIX
from llm_backoff_shim.serve.quota import TenantQuotas
from llm_backoff_shim.serve.request_hooks import RequestHooks, ShimPolicies
from llm_backoff_shim.serve.upstream import UpstreamClient
from llm_backoff_shim.serve.waiting import AsyncAdmission

Clock = Callable[[], float]


def concurrency_limit(settings: ShimSettings, clock: Clock) -> ConcurrencyLimit:
    if not settings.adaptive_concurrency:
        return FixedLimit(settings.max_concurrency)
    return GradientLimit(
        GradientConfig(min_limit=settings.min_concurrency, max_limit=settings.max_concurrency), clock
    )


class _PolicyGauges(Collector):
    def __init__(self, policy: TrafficPolicy) -> None:
        self._policy = policy

    def collect(self) -> Iterable[Metric]:
        families: list[Metric] = []
        detector = self._policy.detector
        if detector is not None:
            for name, text, value in engine_metric_gauges(detector):
                family = GaugeMetricFamily(PREFIX + name, text)
                family.add_metric([], value)
                families.append(family)
        limit = self._policy.limit
        if isinstance(limit, GradientLimit) and limit.baseline is not None:
            baseline = GaugeMetricFamily(
                PREFIX + "adaptive_ttfb_baseline_seconds",
                "Long-term time to first byte the gradient limit compares with",
            )
            baseline.add_metric([], limit.baseline)
            families.append(baseline)
        return families


@dataclass
class TrafficPolicy:
    """What :func:`build_traffic_policy` made; the app starts and stops it with its lifespan."""

    limit: ConcurrencyLimit
    hooks: RequestHooks
    slo: SloTracker | None = None
    detector: SaturationDetector | None = None
    watch: EngineWatch | None = None
    quotas: TenantQuotas | None = None
    admission: AsyncAdmission | None = None

    def slo_state(self, cls: str) -> int:
        return 0 if self.slo is None else int(self.slo.state(cls))

    def collector(self) -> Collector:
        return _PolicyGauges(self)

    def on_first_byte(self, seconds: float, in_flight: int) -> None:
        if isinstance(self.limit, GradientLimit):
            before = self.limit.limit
            self.limit.on_sample(seconds, in_flight)
            if self.limit.limit > before and self.admission is not None:
                self.admission.reschedule()

    def start(self) -> None:
        if self.watch is not None:
            self.watch.start()

    async def stop(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        if self.quotas is not None:
            self.quotas.close()


def build_traffic_policy(
    settings: ShimSettings,
    controller: AdmissionController,
    admission: AsyncAdmission,
    upstream: UpstreamClient,
    clock: Clock,
    *,
    limit: ConcurrencyLimit,
) -> TrafficPolicy:
    scheduler = controller.scheduler
    policy = TrafficPolicy(limit=limit, hooks=RequestHooks(), admission=admission)
    if settings.ttft_slo:
        policy.slo = SloTracker(
            SloConfig(
                budgets=settings.ttft_slo,
                yellow_fraction=settings.slo_yellow_fraction,
                trend_window=settings.slo_trend_window,
            ),
            controller,
            clock,
        )
        controller.gates.append(SloGate(policy.slo))
        if isinstance(scheduler, SharedSlots):
            scheduler.add_hold(policy.slo.holds)
    if settings.engine_metrics:
        policy.detector = SaturationDetector(
            SaturationConfig(
                max_waiting=settings.engine_max_waiting,
                max_kv_cache=settings.engine_max_kv_cache,
                stale_after=settings.engine_stale_after,
            ),
            clock,
            in_flight=controller.in_flight,
        )
        if isinstance(scheduler, SharedSlots):
            scheduler.add_hold(policy.detector.hold)
        policy.watch = EngineWatch(
            policy.detector,
            url=settings.upstream_base + settings.engine_metrics_path,
            session=lambda: upstream.session,
            interval=settings.engine_poll_interval,
            on_change=admission.reschedule,
        )
    tenants_file = (
        load_tenants_file(settings.tenants_file, settings.classes)
        if settings.tenants_file is not None
        else None
    )
    directory = None
    if tenants_file is not None or settings.tenant_header is not None or _limited_by_flags(settings):
        directory = TenantDirectory(
            tenants_file,
            header=settings.tenant_header,
            requests_per_minute=settings.tenant_requests_per_minute,
            tokens_per_minute=settings.tenant_tokens_per_minute,
        )
        if directory.limited:
            policy.quotas = TenantQuotas(clock=clock, redis_url=settings.redis_url)
    if directory is not None or policy.slo is not None or settings.forward_priority:
        policy.hooks = ShimPolicies(
            controller,
            directory=directory,
            quotas=policy.quotas,
            slo=policy.slo,
            vllm_priority=settings.vllm_priority() if settings.forward_priority else None,
        )
    return policy


def _limited_by_flags(settings: ShimSettings) -> bool:
    return any(
        value is not None and math.isfinite(value)
        for value in (settings.tenant_requests_per_minute, settings.tenant_tokens_per_minute)
    )
