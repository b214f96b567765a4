"""OpenTelemetry for wrapped clients: span events for retries and waits, metrics for the counters.

Optional (``pip install 'llm-backoff[otel]'``, which brings ``opentelemetry-api``):
``import llm_backoff`` never imports OpenTelemetry; only importing this module does.

    import llm_backoff.otel
    client = llm_backoff.wrap(openai.OpenAI(...), policy)
    llm_backoff.otel.instrument(client, attributes={"llm_backoff.client": "chat"})

**Span events** go on the span that is current in the calling thread or task when
the event happens: the span of the openai call when an instrumentation such as
``opentelemetry-instrumentation-openai-v2`` or ``-httpx`` makes one, or your own
``tracer.start_as_current_span(...)`` around the call. With no recording span, no
events are made (nothing is created behind your back):

- ``llm_backoff.retry`` before each retry's wait: ``llm_backoff.attempt``,
  ``llm_backoff.retry.reason``, ``llm_backoff.retry.wait`` (s), ``llm_backoff.retry.hint``
  (s, when the server gave one), ``llm_backoff.elapsed`` (s), ``http.request.method``;
- ``llm_backoff.rate_limit_wait`` when the client-side limiter made the call wait (or
  refused it): ``llm_backoff.wait`` (s), ``llm_backoff.granted``;
- ``llm_backoff.retry_budget_exhausted`` when the retry budget refused a retry.

**Metrics** (meter ``llm_backoff``; the same numbers as `llm_backoff.stats.ClientStats`),
each with the ``attributes`` given to `instrument`:

- ``llm_backoff.client.calls`` ({call}), by ``llm_backoff.outcome`` (ok, failed, cancelled);
- ``llm_backoff.client.attempts`` ({attempt});
- ``llm_backoff.client.retries`` ({retry}), by ``llm_backoff.retry.reason`` (a bounded set:
  ``status 429``, ``timeout (ReadTimeout)``...);
- ``llm_backoff.client.retry.wait`` (histogram, s): the backoff chosen before each retry;
- ``llm_backoff.client.budget_refusals`` ({refusal});
- ``llm_backoff.client.limiter.wait`` (histogram, s): each limiter answer, by
  ``llm_backoff.granted`` (false: `RateLimitTimeout`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

try:
    from opentelemetry import metrics, trace
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "llm_backoff.otel needs OpenTelemetry: pip install 'llm-backoff[otel]' (opentelemetry-api)"
    ) from exc

import openai

from . import __version__
from .events import CallObserver, RetryEvent
from .stats import WAIT_THRESHOLD
from .wrap import call_observers

__all__ = ["OtelObserver", "instrument"]

#: Bucket edges for the wait histograms (s): from a limiter's few ms to a long Retry-After.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

Attributes = Mapping[str, str | bool | int | float]


class OtelObserver(CallObserver):
    """Turns a client's call events into span events and OpenTelemetry metrics."""

    def __init__(
        self,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        attributes: Attributes | None = None,
        span_events: bool = True,
    ) -> None:
        self._attributes = dict(attributes or {})
        self._span_events = span_events
        meter = metrics.get_meter("llm_backoff", __version__, meter_provider=meter_provider)
        self._calls = meter.create_counter(
            "llm_backoff.client.calls", "{call}", "Logical calls finished, by outcome"
        )
        self._attempts = meter.create_counter(
            "llm_backoff.client.attempts", "{attempt}", "HTTP attempts that got a response or an error"
        )
        self._retries = meter.create_counter("llm_backoff.client.retries", "{retry}", "Retries, by reason")
        self._retry_wait = meter.create_histogram(
            "llm_backoff.client.retry.wait",
            "s",
            "Backoff chosen before each retry",
            explicit_bucket_boundaries_advisory=WAIT_BUCKETS,
        )
        self._refusals = meter.create_counter(
            "llm_backoff.client.budget_refusals", "{refusal}", "Retries the retry budget refused"
        )
        self._limiter_wait = meter.create_histogram(
            "llm_backoff.client.limiter.wait",
            "s",
            "Time each client-side limiter answer took, by whether a permit was granted",
            explicit_bucket_boundaries_advisory=WAIT_BUCKETS,
        )
        # Attribute dicts built once: these run on every call.
        self._outcome_attrs = {
            outcome: {**self._attributes, "llm_backoff.outcome": outcome}
            for outcome in ("ok", "failed", "cancelled")
        }
        self._granted_attrs = {
            granted: {**self._attributes, "llm_backoff.granted": granted} for granted in (True, False)
        }

    def call_ended(self, outcome: str, attempts: int) -> None:
        attrs = self._outcome_attrs.get(outcome) or {**self._attributes, "llm_backoff.outcome": outcome}
        self._calls.add(1, attrs)
        if attempts:
            self._attempts.add(attempts, self._attributes)

    def retrying(self, event: RetryEvent) -> None:
        self._retries.add(1, {**self._attributes, "llm_backoff.retry.reason": event.reason})
        self._retry_wait.record(event.wait, self._attributes)
        if not self._span_events:
            return
        span = trace.get_current_span()
        if not span.is_recording():
            return
        attrs: dict[str, str | int | float] = {
            "llm_backoff.attempt": event.attempt,
            "llm_backoff.retry.reason": event.reason,
            "llm_backoff.retry.wait": event.wait,
            "llm_backoff.elapsed": event.elapsed,
            "http.request.method": event.method,
        }
        if event.hint is not None:
            attrs["llm_backoff.retry.hint"] = event.hint
        span.add_event("llm_backoff.retry", attrs)

    def budget_refused(self) -> None:
        self._refusals.add(1, self._attributes)
        if self._span_events:
            span = trace.get_current_span()
            if span.is_recording():
                span.add_event("llm_backoff.retry_budget_exhausted")

    def limiter_waited(self, seconds: float, *, granted: bool) -> None:
        self._limiter_wait.record(seconds, self._granted_attrs[granted])
        if self._span_events and (seconds >= WAIT_THRESHOLD or not granted):
            span = trace.get_current_span()
            if span.is_recording():
                span.add_event(
                    "llm_backoff.rate_limit_wait",
                    {"llm_backoff.wait": seconds, "llm_backoff.granted": granted},
                )


def instrument(
    client: openai.OpenAI | openai.AsyncOpenAI,
    *,
    meter_provider: metrics.MeterProvider | None = None,
    attributes: Attributes | None = None,
    span_events: bool = True,
) -> Callable[[], None]:
    """Report a wrapped client's retries and waits to OpenTelemetry; returns the undo function.

    ``meter_provider`` defaults to the global one (a no-op until the application
    sets one up). ``attributes`` go on every data point, e.g. which client this is;
    keep their values few. Clients derived with ``copy()``/``with_options()`` share
    the instrumentation; instrumenting one client twice counts everything twice.
    """
    observer = OtelObserver(meter_provider=meter_provider, attributes=attributes, span_events=span_events)
    return call_observers(client).subscribe(observer)
