"""EventCounts: the per-request counters and histograms render as prometheus-client's would."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llm_backoff_shim.serve.observe.event_counts import EventCounts, LabelledCounter, LabelledHistogram


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_histogram_matches_the_client_library_bucket_for_bucket() -> None:
    buckets = (0.005, 0.01, 0.1, 1, 10)
    values = [0.0, 0.005, 0.0051, 0.01, 0.5, 1.0, 9.99, 10.0, 10.01, 1e9, -1.0]
    ours = LabelledHistogram("t_seconds", "doc", "class", buckets)
    ours_registry = CollectorRegistry()
    ours_registry.register(EventCounts([ours]))
    theirs_registry = CollectorRegistry()
    theirs = Histogram("t_seconds", "doc", ["class"], buckets=buckets, registry=theirs_registry)
    for value in values:
        ours.observe("a", value)
        theirs.labels("a").observe(value)
    assert samples(ours_registry) == samples(theirs_registry)


def test_counter_primes_zeros_and_counts() -> None:
    counter = LabelledCounter("req", "doc", ["class", "outcome"])
    counter.prime(("a", "ok"))
    counter.prime(("a", "ok"))  # priming twice keeps one series at zero
    registry = CollectorRegistry()
    registry.register(EventCounts([counter]))
    assert samples(registry) == {("req_total", (("class", "a"), ("outcome", "ok"))): 0.0}
    counter.inc(("a", "ok"))
    counter.inc(("b", "failed"))
    counter.inc(("a", "ok"))
    assert samples(registry) == {
        ("req_total", (("class", "a"), ("outcome", "ok"))): 2.0,
        ("req_total", (("class", "b"), ("outcome", "failed"))): 1.0,
    }


def test_primed_histogram_exports_empty_series() -> None:
    histogram = LabelledHistogram("h_seconds", "doc", "class", (1, 2))
    histogram.prime("x")
    registry = CollectorRegistry()
    registry.register(EventCounts([histogram]))
    got = samples(registry)
    assert got[("h_seconds_count", (("class", "x"),))] == 0.0
    assert got[("h_seconds_bucket", (("class", "x"), ("le", "+Inf")))] == 0.0


@pytest.mark.parametrize("buckets", [(), (2, 1), (1, math.nan)])
def test_rejects_unordered_or_empty_buckets(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="increasing"):
        LabelledHistogram("h", "doc", "class", buckets)
