"""The shim's Prometheus metrics, in a per-app registry (several shims may share a process).

Events are counted as they happen; levels (in flight, queue depth, drain rate, SLO
state) are read from the live admission state at scrape time by a collector, so they
can never drift from the truth. Label values are bounded: ``class`` is one of the
configured classes, ``outcome`` and ``code`` come from fixed lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llm_backoff_shim.admission import AdmissionController

PREFIX = "llm_backoff_shim_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

OUTCOMES = ("admitted", "completed", "rejected", "client_disconnected", "upstream_error")
REJECT_CODES = ("queue_full", "queue_timeout", "slo_shed", "tenant_rate_limited", "upstream_unavailable")
#: Why the shim refused a request as malformed or hostile (``bad_requests_total{reason}``).
BAD_REQUEST_REASONS = (
    "malformed_json",
    "unsupported_media_type",
    "body_too_large",
    "body_timeout",
    "invalid_header",
    "unknown_class",
    "bad_path",
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
            PREFIX + "drain_rate", "Completions per second (decaying average)", labels=["class"]
        )
        slo = GaugeMetricFamily(PREFIX + "slo_state", "SLO state: 0 green, 1 yellow, 2 red", labels=["class"])
        for cls in c.classes:
            in_flight.add_metric([cls], c.in_flight(cls))
            depth.add_metric([cls], c.queued(cls))
            drain.add_metric([cls], c.estimator.completion_rate(cls))
            slo.add_metric([cls], self._slo_state(cls))
        limit = GaugeMetricFamily(PREFIX + "concurrency_limit", "Current cap on requests in flight")
        limit.add_metric([], c.limit)
        return [in_flight, depth, drain, slo, limit]


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
        self.requests = Counter(
            PREFIX + "requests",
            "Generation requests by class and outcome (code: the rejection code, else empty)",
            ["class", "outcome", "code"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            PREFIX + "queue_wait_seconds",
            "Seconds admitted requests waited for a slot",
            ["class"],
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            PREFIX + "time_to_first_byte_seconds",
            "Seconds from arrival at the shim to the first upstream response byte",
            ["class"],
            buckets=_TTFB_BUCKETS,
            registry=self.registry,
        )
        self.retry_after = Histogram(
            PREFIX + "retry_after_seconds",
            "Retry-After hints given with rejections",
            ["class"],
            buckets=_RETRY_BUCKETS,
            registry=self.registry,
        )
        self.bad_requests = Counter(
            PREFIX + "bad_requests",
            "Requests refused as malformed, hostile or unauthenticated, by reason",
            ["reason"],
            registry=self.registry,
        )
        for reason in BAD_REQUEST_REASONS:
            self.bad_requests.labels(reason)
        self._requests_by_label: dict[tuple[str, str, str], Counter] = {}
        self._children: dict[tuple[Histogram, str], Histogram] = {}
        self.registry.register(_LiveState(controller, slo_state or (lambda _cls: 0)))
        self._prime(controller.classes)

    def _prime(self, classes: Sequence[str]) -> None:
        # Export zeros from the start, so rate() works on the first event and a
        # dashboard sees every series before anything happens.
        for cls in classes:
            for outcome in OUTCOMES:
                if outcome != "rejected":
                    self.requests.labels(cls, outcome, "")
            for code in REJECT_CODES:
                self.requests.labels(cls, "rejected", code)
            self.queue_wait.labels(cls)
            self.time_to_first_byte.labels(cls)
            self.retry_after.labels(cls)

    def count(self, cls: str, outcome: str, code: str = "") -> None:
        self._request_counter(cls, outcome, code).inc()

    def rejected(self, cls: str, code: str, retry_after: float) -> None:
        self._request_counter(cls, "rejected", code).inc()
        self.retry_after.labels(cls).observe(retry_after)

    def _request_counter(self, cls: str, outcome: str, code: str) -> Counter:
        # labels() takes a lock and builds a key on every call; this runs several times per
        # request (bench/bench_proxy.py). Classes, outcomes and codes are few: the dict stays small.
        key = (cls, outcome, code)
        child = self._requests_by_label.get(key)
        if child is None:
            child = self._requests_by_label[key] = self.requests.labels(cls, outcome, code)
        return child

    def observe_queue_wait(self, cls: str, seconds: float) -> None:
        self._child(self.queue_wait, cls).observe(seconds)

    def observe_first_byte(self, cls: str, seconds: float) -> None:
        self._child(self.time_to_first_byte, cls).observe(seconds)

    def _child(self, histogram: Histogram, cls: str) -> Histogram:
        # As _request_counter: skip labels()' lock and key building on every request.
        key = (histogram, cls)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = histogram.labels(cls)
        return child

    def bad_request(self, reason: str) -> None:
        # An unlisted reason would be an unbounded label: fold it into the nearest bucket.
        self.bad_requests.labels(reason if reason in BAD_REQUEST_REASONS else "malformed_http").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
