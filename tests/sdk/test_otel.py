"""llm_backoff.otel: span events and metrics with the OpenTelemetry SDK's in-memory readers.

Providers are passed explicitly (never installed globally), so tests do not leak
into each other.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import openai
import pytest

import llm_backoff
from llm_backoff import RateLimitTimeout, RetryPolicy
from llm_backoff.budget import RetryBudget
from llm_backoff.ratelimit import RateLimiter
from llm_backoff.testing import instant_retries
from llm_backoff.wrap import _engine_of, client_stats

pytest.importorskip("opentelemetry.sdk", reason="needs opentelemetry-sdk (the test extra)")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import llm_backoff.otel as otel

OPENAI3 = openai.__version__.startswith("3.")
Handler = Callable[[Any], Any]


@pytest.fixture
def http(lib: ModuleType) -> ModuleType:
    if lib.__name__ == "httpx2" and not OPENAI3:
        pytest.skip("openai 2.x takes httpx clients only")
    return lib


def script(http: ModuleType, *answers: tuple[int, ...]) -> Handler:
    seen: list[Any] = []

    def handler(request: Any) -> Any:
        seen.append(request)
        status, *hint = answers[min(len(seen), len(answers)) - 1]
        headers = {"retry-after": str(hint[0])} if hint else {}
        body = {"object": "list", "data": []} if status < 400 else {"error": {"message": "busy"}}
        return http.Response(status, headers=headers, json=body)

    return handler


def client(http: ModuleType, handler: Handler, is_async: bool = False) -> Any:
    if is_async:
        return openai.AsyncOpenAI(
            api_key="sk-otel-secret",
            base_url="http://llm.test/v1",
            http_client=http.AsyncClient(transport=http.MockTransport(handler)),
        )
    return openai.OpenAI(
        api_key="sk-otel-secret",
        base_url="http://llm.test/v1",
        http_client=http.Client(transport=http.MockTransport(handler)),
    )


class Telemetry:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.tracer = self.tracer_provider.get_tracer("test")
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def total(self, name: str, **attrs: Any) -> float:
        points = self.points(name)
        return float(sum(p.value for p in points if all(p.attributes.get(k) == v for k, v in attrs.items())))

    def events(self) -> list[Any]:
        return [event for span in self.spans.get_finished_spans() for event in span.events]


@pytest.fixture
def telemetry() -> Telemetry:
    return Telemetry()


def test_retries_become_span_events_and_metrics(http: ModuleType, telemetry: Telemetry) -> None:
    waits: list[float] = []
    wrapped = llm_backoff.wrap(
        client(http, script(http, (429, 2), (503,), (200,))),
        RetryPolicy(max_attempts=5),
        on_retry=lambda e: waits.append(e.wait),
    )
    otel.instrument(wrapped, meter_provider=telemetry.meter_provider, attributes={"app.client": "chat"})
    with instant_retries(), telemetry.tracer.start_as_current_span("chat call"):
        wrapped.models.list()

    events = telemetry.events()
    assert [e.name for e in events] == ["llm_backoff.retry", "llm_backoff.retry"]
    first, second = (dict(e.attributes) for e in events)
    assert first["llm_backoff.attempt"] == 1
    assert first["llm_backoff.retry.reason"] == "status 429"
    assert first["llm_backoff.retry.hint"] == 2.0
    assert first["http.request.method"] == "GET"
    assert [first["llm_backoff.retry.wait"], second["llm_backoff.retry.wait"]] == waits
    assert second["llm_backoff.retry.reason"] == "status 503"
    assert "llm_backoff.retry.hint" not in second

    assert telemetry.total("llm_backoff.client.calls", **{"llm_backoff.outcome": "ok"}) == 1
    assert telemetry.total("llm_backoff.client.attempts", **{"app.client": "chat"}) == 3
    assert telemetry.total("llm_backoff.client.retries", **{"llm_backoff.retry.reason": "status 429"}) == 1
    assert telemetry.total("llm_backoff.client.retries", **{"llm_backoff.retry.reason": "status 503"}) == 1
    (wait,) = telemetry.points("llm_backoff.client.retry.wait")
    assert wait.count == 2
    assert wait.sum == pytest.approx(sum(waits))
    assert wait.attributes == {"app.client": "chat"}
    # The same numbers as the client's own stats.
    stats = client_stats(wrapped).snapshot()
    assert (stats.calls, stats.attempts, stats.retries) == (1, 3, 2)
    assert stats.retry_wait_seconds == pytest.approx(wait.sum)


async def test_async_failure_budget_and_undo(http: ModuleType, telemetry: Telemetry) -> None:
    budget = RetryBudget(ratio=0.0, min_per_second=0.1, ttl=10.0)  # one retry in reserve
    wrapped = llm_backoff.wrap(client(http, script(http, (503,)), is_async=True), budget=budget)
    undo = otel.instrument(wrapped, meter_provider=telemetry.meter_provider)
    with (
        instant_retries(),
        telemetry.tracer.start_as_current_span("call"),
        pytest.raises(openai.InternalServerError),
    ):
        await wrapped.models.list()
    names = [e.name for e in telemetry.events()]
    assert names == ["llm_backoff.retry", "llm_backoff.retry_budget_exhausted"]
    assert telemetry.total("llm_backoff.client.calls", **{"llm_backoff.outcome": "failed"}) == 1
    assert telemetry.total("llm_backoff.client.budget_refusals") == 1

    undo()
    with instant_retries(), pytest.raises(openai.InternalServerError):
        await wrapped.models.list()
    assert telemetry.total("llm_backoff.client.calls") == 1  # no longer reported
    assert client_stats(wrapped).calls == 2  # the stats go on counting


def test_limiter_waits_and_timeouts(http: ModuleType, telemetry: Telemetry) -> None:
    # A frozen clock for the limiter and the retry engine: asking the limiter then takes no time
    # however loaded the machine (a real clock can count a slow ask as a 1 ms wait).
    frozen = time.monotonic()
    limiter = RateLimiter(requests_per_second=0.01, burst=1, clock=lambda: frozen)
    wrapped = llm_backoff.wrap(client(http, script(http, (200,))), RetryPolicy(deadline=1.0), limiter=limiter)
    _engine_of(wrapped).clock = lambda: frozen
    otel.instrument(wrapped, meter_provider=telemetry.meter_provider)
    with telemetry.tracer.start_as_current_span("call"):
        wrapped.models.list()  # the burst: no wait, no span event
        with pytest.raises(RateLimitTimeout):
            wrapped.models.list()  # next permit in 100 s, past the 1 s deadline
    events = telemetry.events()
    assert [e.name for e in events] == ["llm_backoff.rate_limit_wait"]
    assert events[0].attributes["llm_backoff.granted"] is False
    granted = [
        p for p in telemetry.points("llm_backoff.client.limiter.wait") if p.attributes["llm_backoff.granted"]
    ]
    refused = [
        p
        for p in telemetry.points("llm_backoff.client.limiter.wait")
        if not p.attributes["llm_backoff.granted"]
    ]
    assert (granted[0].count, refused[0].count) == (1, 1)
    assert telemetry.total("llm_backoff.client.calls", **{"llm_backoff.outcome": "failed"}) == 1


def test_without_a_recording_span_only_metrics(http: ModuleType, telemetry: Telemetry) -> None:
    wrapped = llm_backoff.wrap(client(http, script(http, (429, 1), (200,))))
    otel.instrument(wrapped, meter_provider=telemetry.meter_provider, span_events=True)
    with instant_retries():
        wrapped.models.list()
    assert telemetry.events() == []
    assert telemetry.total("llm_backoff.client.retries") == 1


def test_no_secrets_or_prompts_in_telemetry(http: ModuleType, telemetry: Telemetry) -> None:
    wrapped = llm_backoff.wrap(client(http, script(http, (429, 1), (200,))))
    otel.instrument(wrapped, meter_provider=telemetry.meter_provider)
    with instant_retries(), telemetry.tracer.start_as_current_span("call"):
        wrapped.models.list()
    exported = repr([dict(e.attributes) for e in telemetry.events()]) + repr(
        telemetry.reader.get_metrics_data()
    )
    assert "sk-otel-secret" not in exported
    assert "llm_backoff.retry.reason" in exported


def test_llm_backoff_alone_never_imports_opentelemetry() -> None:
    # A fresh interpreter (this one has OpenTelemetry loaded already); one process for
    # both checks, since importing openai is most of the cost.
    code = """
import sys, openai, llm_backoff
llm_backoff.wrap(openai.OpenAI(api_key="k", base_url="http://127.0.0.1:9/v1"))
llm_backoff.wrap(openai.AsyncOpenAI(api_key="k", base_url="http://127.0.0.1:9/v1"))
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
if loaded:
    print("loaded:", loaded)
    sys.exit(1)
sys.modules["opentelemetry"] = None  # as if opentelemetry-api were not installed
try:
    import llm_backoff.otel
except ImportError as exc:
    print(exc)
    sys.exit(0)
sys.exit(2)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "llm-backoff[otel]" in result.stdout
