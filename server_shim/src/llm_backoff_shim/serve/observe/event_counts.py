"""Per-request counters and histograms as plain integers, exported by a Prometheus collector.

Why not prometheus-client's ``Counter`` and ``Histogram`` for these: every relayed request
updates two counters and two histograms, and each update of a client-library metric
takes a lock per value (a histogram: the sum and one bucket), checks observability and
handles exemplars. In the in-process profile of the relay that was about a tenth of the
shim's own CPU per request. Everything that updates these runs on the event loop's
thread, so a dict entry or list item increment is enough; the scrape (possibly from the
metrics thread) copies the values under the GIL and renders them through the library's
own metric families, so the exposition format is the library's. A scrape may see a
request's count without its bucket for an instant, as it can with the library's
separately locked values.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import cast

from prometheus_client import utils
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# The library's own bucket-bound formatting ("0.005", "1.0", "+Inf"), so the text is the library's.
_go_float = cast(Callable[[float], str], utils.floatToGoString)


class LabelledCounter:
    """A counter family: ``inc(labels)``; ``prime(labels)`` exports a zero series up front."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.values: dict[tuple[str, ...], int] = {}

    def prime(self, labels: tuple[str, ...]) -> None:
        self.values.setdefault(labels, 0)

    def inc(self, labels: tuple[str, ...]) -> None:
        values = self.values
        values[labels] = values.get(labels, 0) + 1

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            family.add_metric(list(labels), value)
        return family


class _Series:
    __slots__ = ("counts", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)  # the last one is +Inf
        self.total = 0.0


class LabelledHistogram:
    """A histogram family with one label: ``observe(label, value)``."""

    def __init__(self, name: str, documentation: str, labelname: str, buckets: Sequence[float]) -> None:
        finite = all(math.isfinite(b) for b in buckets)
        if not buckets or not finite or any(a >= b for a, b in itertools.pairwise(buckets)):
            raise ValueError("buckets must be a non-empty increasing sequence of finite bounds")
        self.name = name
        self.documentation = documentation
        self.labelname = labelname
        self.bounds = tuple(float(b) for b in buckets)
        self.series: dict[str, _Series] = {}

    def prime(self, label: str) -> None:
        if label not in self.series:
            self.series[label] = _Series(len(self.bounds))

    def observe(self, label: str, value: float) -> None:
        series = self.series.get(label)
        if series is None:
            series = self.series[label] = _Series(len(self.bounds))
        # Prometheus buckets are "less than or equal": the first bound >= value.
        series.counts[bisect.bisect_left(self.bounds, value)] += 1
        series.total += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.labelname])
        bounds = [_go_float(b) for b in self.bounds] + [_go_float(math.inf)]
        for label, series in list(self.series.items()):
            counts = list(series.counts)
            cumulative, running = [], 0
            for bound, count in zip(bounds, counts, strict=True):
                running += count
                cumulative.append((bound, running))
            family.add_metric([label], cumulative, sum_value=series.total)
        return family


class EventCounts(Collector):
    """The collector that exports a set of :class:`LabelledCounter` and :class:`LabelledHistogram`."""

    def __init__(self, metrics: Iterable[LabelledCounter | LabelledHistogram]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return [metric.family() for metric in self._metrics]
