"""The traffic policies around the shim core, as one object the edge starts, stops and asks.

- the concurrency limit: fixed ``--max-concurrency``, or the gradient limit
  (``--adaptive-concurrency``) fed with time-to-first-byte samples by the relay;
- the SLO tracker: a gate on the controller (RED / YELLOW shedding), a hold on the
  scheduler (lower classes wait while a higher one is YELLOW or RED), the
  ``slo_state`` gauge and the ``x-slo-state`` header;
- the engine watch: a hold on the scheduler while the engine is saturated and a task
  that scrapes the upstream's metrics;
- the request hooks (:class:`~llm_backoff_shim.serve.policy.request_hooks.ShimPolicies`): classes
  by tenant, tenant quotas (local or Redis), vLLM priority.

The composition root (app.py) builds each piece and wires it into the controller and
the scheduler; :class:`TrafficPolicy` is what the edge sees of them: the request hooks,
the time-to-first-byte feed of the limit, their gauges, and their start and stop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llm_backoff_shim.decide.adaptive_limit import GradientLimit
from llm_backoff_shim.decide.limit import ConcurrencyLimit
from llm_backoff_shim.decide.saturation import SaturationDetector
from llm_backoff_shim.decide.slo import SloTracker
from llm_backoff_shim.serve.observe.metrics import PREFIX
from llm_backoff_shim.serve.policy.engine_watch import EngineWatch, engine_metric_gauges
from llm_backoff_shim.serve.policy.quota import TenantQuotas
from llm_backoff_shim.serve.policy.request_hooks import RequestHooks


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
    """The policies the composition root built; the app starts and stops it with its lifespan."""

    limit: ConcurrencyLimit
    hooks: RequestHooks
    slo: SloTracker | None = None
    detector: SaturationDetector | None = None
    watch: EngineWatch | None = None
    quotas: TenantQuotas | None = None
    #: Lets queued requests move after a change from outside the controller (the waiting queue's).
    reschedule: Callable[[], None] | None = None

    def slo_state(self, cls: str) -> int:
        return 0 if self.slo is None else int(self.slo.state(cls))

    def collector(self) -> Collector:
        return _PolicyGauges(self)

    def on_first_byte(self, seconds: float, in_flight: int) -> None:
        if isinstance(self.limit, GradientLimit):
            before = self.limit.limit
            self.limit.on_sample(seconds, in_flight)
            if self.limit.limit > before and self.reschedule is not None:
                self.reschedule()

    def start(self) -> None:
        if self.watch is not None:
            self.watch.start()

    async def stop(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        if self.quotas is not None:
            self.quotas.close()
