"""Prometheus metrics of the simulator, under vLLM's names (plus ``sim_*`` accounting).

Gauges and counters are read from the engine at scrape time by a custom collector, so
the token path never touches a metric; only the three latency histograms are observed
as sequences progress. Each app has its own ``CollectorRegistry`` (several simulators
run in one test process). Labels follow vLLM V1: ``model_name`` and ``engine="0"``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine import Sequence, SimEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries, so dashboards built against vLLM read the same quantiles.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

_LABELS = ("model_name", "engine")


class _EngineCollector(Collector):
    def __init__(self, engine: SimEngine, model: str) -> None:
        self._engine = engine
        self._labels = [model, "0"]

    def collect(self) -> Iterator[Metric]:
        engine, labels = self._engine, self._labels
        stats = engine.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", engine.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_cache_usage
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", stats.tokens_generated
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions
        )

        yield counter(
            "sim_requests_received", "Generation requests received (valid JSON).", stats.requests_received
        )
        yield counter("sim_requests_invalid", "Generation requests refused with 400.", stats.requests_invalid)
        yield counter(
            "sim_requests_completed", "Requests that generated every token.", stats.requests_completed
        )
        yield counter("sim_requests_aborted", "Requests whose client went away.", stats.requests_aborted)
        yield counter(
            "sim_aborted_tokens",
            "Tokens generated for requests whose client went away.",
            stats.aborted_tokens,
        )
        yield counter(
            "sim_requests_rejected",
            "Requests refused with 503 (max_num_queued_reqs).",
            stats.requests_rejected,
        )
        yield counter("sim_tokens_generated", "Tokens generated for all requests.", stats.tokens_generated)
        yield gauge(
            "sim_peak_running", "Highest number of running requests since start/reset.", stats.peak_running
        )
        yield gauge(
            "sim_peak_waiting", "Highest number of waiting requests since start/reset.", stats.peak_waiting
        )
        faults = CounterMetricFamily("sim_injected_faults", "Faults injected, by kind.", labels=["kind"])
        faults.add_metric(["error"], stats.injected_errors)
        faults.add_metric(["reset"], stats.injected_resets)
        faults.add_metric(["slow_first_byte"], stats.injected_slow_first_byte)
        faults.add_metric(["stream_cut"], stats.injected_stream_cuts)
        yield faults


class SimMetrics:
    """The simulator's registry: vLLM histograms plus the engine collector."""

    def __init__(self, engine: SimEngine, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model))
        ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _LABELS,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LABELS,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=self.registry,
        )
        queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _LABELS,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._ttft = ttft.labels(model, "0")
        self._e2e = e2e.labels(model, "0")
        self._queue = queue.labels(model, "0")

    def observe_token(self, seq: Sequence) -> None:
        """Called for every sequence that emitted a token in an engine step."""
        if seq.generated == 1 and seq.first_token_at is not None:
            self._ttft.observe(seq.first_token_at - seq.arrival)
        if seq.finished_at is not None and seq.generated >= seq.max_tokens:
            self._e2e.observe(seq.finished_at - seq.arrival)
            if seq.admitted_at is not None:
                self._queue.observe(seq.admitted_at - seq.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
