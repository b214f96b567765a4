"""The shim's Prometheus metrics, in a per-app registry (several shims may share a process).

Events are counted as they happen; levels (in flight, queue depth, drain rate, SLO
state) are read from the live admission state at scrape time by a collector, so they
can never drift from the truth. Label values are bounded: ``class`` is one of the
configured classes, ``outcome`` and ``code`` come from fixed lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.serve.observe.event_counts import EventCounts, LabelledCounter, LabelledHistogram

PREFIX = "llm_backoff_shim_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

OUTCOMES = ("admitted", "completed", "rejected", "client_disconnected", "upstream_error")
REJECT_CODES = ("queue_full", "queue_timeout", "slo_shed", "tenant_rate_limited", "upstream_unavailable")
#: Why the shim refused a request as malformed or hostile (``bad_requests_total{reason}``).
BAD_REQUEST_REASONS = (
    "invalid_json",
    "unsupported_media_type",
    "body_too_large",
    "body_timeout",
    "invalid_header",
    "invalid_request_class",
    "bad_path",
    "operator_route",
    "unauthorized",
    "header_timeout",
    "headers_too_large",
    "malformed_http",
)

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RETRY_BUCKETS = (1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120)


class _LiveState(Collector):
    def __init__(self, controller: AdmissionController, slo_state: Callable[[str], int]) -> None:
        self._controller = controller
        self._slo_state = slo_state

    def collect(self) -> Iterable[Metric]:
        c = self._controller
        in_flight = GaugeMetricFamily(
            PREFIX + "in_flight", "Requests holding a slot upstream", labels=["class"]
        )
        depth = GaugeMetricFamily(PREFIX + "queue_depth", "Requests waiting for a slot", labels=["class"])
        drain = GaugeMetricFamily(
            PREFIX + "drain_rate_per_second", "Completions per second (decaying average)", labels=["class"]
        )
        slo = GaugeMetricFamily(PREFIX + "slo_state", "SLO state: 0 green, 1 yellow, 2 red", labels=["class"])
        for cls in c.classes:
            in_flight.add_metric([cls], c.in_flight(cls))
            depth.add_metric([cls], c.queued(cls))
            drain.add_metric([cls], c.estimator.completion_rate(cls))
            slo.add_metric([cls], self._slo_state(cls))
        limit = GaugeMetricFamily(PREFIX + "concurrency_limit", "Current cap on requests in flight")
        limit.add_metric([], c.limit)
        overtaken = CounterMetricFamily(
            PREFIX + "overtaken",
            "Queued requests turned away with queue_timeout because the estimate moved after they queued",
        )
        overtaken.add_metric([], c.overtaken_total)
        metrics: list[Metric] = [in_flight, depth, drain, slo, limit, overtaken]
        budget = c.token_budget
        if budget is not None:
            tokens = GaugeMetricFamily(
                PREFIX + "in_flight_tokens",
                "Cost of the requests holding a slot: estimated prompt plus max_tokens, in tokens",
            )
            tokens.add_metric([], c.in_flight_tokens())
            cap = GaugeMetricFamily(
                PREFIX + "max_inflight_tokens", "Cost budget of the requests in flight, in tokens"
            )
            cap.add_metric([], budget)
            metrics += [tokens, cap]
        if c.estimator.promises.fleet is not None:
            fleet = GaugeMetricFamily(
                PREFIX + "fleet_replicas",
                "Most replicas seen refusing one call in the last minute (--fleet-retry-after)",
            )
            fleet.add_metric([], c.estimator.promises.replicas)
            metrics.append(fleet)
        return metrics


class ShimMetrics:
    """Counters and histograms of one shim, plus its live-state collector."""

    def __init__(
        self,
        controller: AdmissionController,
        *,
        registry: CollectorRegistry | None = None,
        slo_state: Callable[[str], int] | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # Updated on every request: plain integers behind one collector (event_counts.py says why).
        self.requests = LabelledCounter(
            PREFIX + "requests",
            "Generation requests by class and outcome (code: the rejection code, else empty)",
            ["class", "outcome", "code"],
        )
        self.queue_wait = LabelledHistogram(
            PREFIX + "queue_wait_seconds",
            "Seconds admitted requests waited for a slot",
            "class",
            _WAIT_BUCKETS,
        )
        self.time_to_first_byte = LabelledHistogram(
            PREFIX + "time_to_first_byte_seconds",
            "Seconds from arrival at the shim to the first upstream response byte",
            "class",
            _TTFB_BUCKETS,
        )
        self.retry_after = LabelledHistogram(
            PREFIX + "retry_after_seconds", "Retry-After hints given with rejections", "class", _RETRY_BUCKETS
        )
        # A caller's attempt is one request to the load balancer, asked of one replica or more
        # (policy/fleet_attempts.py); without the fleet's record every request is its own.
        self.attempts = LabelledCounter(
            PREFIX + "attempts",
            "Callers' attempts whose first try reached this replica, by what it answered"
            " (code: the rejection code, else empty)",
            ["class", "outcome", "code"],
        )
        self.rescues = LabelledCounter(
            PREFIX + "rescues",
            "Callers' attempts another replica rejected first (code: its rejection code) that this"
            " replica admitted",
            ["class", "code"],
        )
        self.registry.register(
            EventCounts(
                [
                    self.requests,
                    self.attempts,
                    self.rescues,
                    self.queue_wait,
                    self.time_to_first_byte,
                    self.retry_after,
                ]
            )
        )
        self.bad_requests = Counter(
            PREFIX + "bad_requests",
            "Requests refused as malformed, hostile or unauthenticated, by reason",
            ["reason"],
            registry=self.registry,
        )
        for reason in BAD_REQUEST_REASONS:
            self.bad_requests.labels(reason)
        self.registry.register(_LiveState(controller, slo_state or (lambda _cls: 0)))
        self._prime(controller.classes)

    def _prime(self, classes: Sequence[str]) -> None:
        # Export zeros from the start, so rate() works on the first event and a
        # dashboard sees every series before anything happens.
        for cls in classes:
            for outcome in OUTCOMES:
                if outcome != "rejected":
                    self.requests.prime((cls, outcome, ""))
            self.attempts.prime((cls, "admitted", ""))
            for code in REJECT_CODES:
                self.requests.prime((cls, "rejected", code))
                self.attempts.prime((cls, "rejected", code))
                self.rescues.prime((cls, code))
            self.queue_wait.prime(cls)
            self.time_to_first_byte.prime(cls)
            self.retry_after.prime(cls)

    def count(self, cls: str, outcome: str, code: str = "") -> None:
        self.requests.inc((cls, outcome, code))

    def rejected(self, cls: str, code: str, retry_after: float) -> None:
        self.requests.inc((cls, "rejected", code))
        self.retry_after.observe(cls, retry_after)

    def attempt(self, cls: str, code: str = "") -> None:
        """A caller's attempt whose first try this replica admitted (``code`` empty) or
        rejected with ``code``."""
        self.attempts.inc((cls, "rejected", code) if code else (cls, "admitted", ""))

    def rescued(self, cls: str, code: str) -> None:
        """A caller's attempt another replica rejected with ``code`` that this one admitted."""
        if code in REJECT_CODES:  # the record's code is another shim's: keep the label bounded
            self.rescues.inc((cls, code))

    def observe_queue_wait(self, cls: str, seconds: float) -> None:
        self.queue_wait.observe(cls, seconds)

    def observe_first_byte(self, cls: str, seconds: float) -> None:
        self.time_to_first_byte.observe(cls, seconds)

    def bad_request(self, reason: str) -> None:
        # An unlisted reason would be an unbounded label: fold it into the nearest bucket.
        self.bad_requests.labels(reason if reason in BAD_REQUEST_REASONS else "malformed_http").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
