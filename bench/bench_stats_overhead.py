"""Cost of the per-client telemetry (ClientStats, optional OpenTelemetry) on a successful call.

Three retry transports over one in-process mock transport (no sockets), side by side
in interleaved rounds: the engine with no observer at all, with its `ClientStats`
(the default of every wrapped client), and with ClientStats plus the OpenTelemetry
observer (SDK meter provider, no span). Each row is the median over rounds of its
CPU time per call next to the bare row measured in the same round; the difference
is the observers' cost (the plain httpx2 client plus our retry layer is the baseline,
so the absolute microseconds are comparable across rows).

    .venv/bin/python bench/bench_stats_overhead.py [--rounds 31] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx2

from llm_backoff.events import CallObservers
from llm_backoff.transport import Httpx2RetryTransport

BODY = b'{"ok": true}'


def handler(request: httpx2.Request) -> httpx2.Response:
    return httpx2.Response(200, headers={"content-type": "application/json"}, content=BODY)


def client(kind: str) -> httpx2.Client:
    transport = Httpx2RetryTransport(httpx2.MockTransport(handler))
    engine = transport.engine
    if kind == "none":
        engine.watchers = CallObservers()
    elif kind == "otel":
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        from llm_backoff.otel import OtelObserver

        provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
        engine.watchers.subscribe(OtelObserver(meter_provider=provider))
    return httpx2.Client(transport=transport, base_url="http://bench")


def per_call(c: httpx2.Client, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        c.post("/v1/chat/completions", content=b"{}")
    return (time.process_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    kinds = ["none", "stats", "otel"]
    try:
        import opentelemetry.sdk  # noqa: F401
    except ImportError:
        kinds.remove("otel")
        print("opentelemetry-sdk not installed: the otel row is skipped")
    clients = {kind: client(kind) for kind in kinds}
    for c in clients.values():
        per_call(c, 200)  # warm-up
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(args.rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for kind in order:
            times[kind].append(per_call(clients[kind], args.calls))
        line = ", ".join(f"{k} {times[k][-1]:6.1f} us" for k in kinds)
        print(f"round {r + 1:2d}/{args.rounds}: {line}", flush=True)
    print()
    print("| observers | us/call (median) | us/call (min) | median extra vs none (same round) |")
    print("| --- | ---: | ---: | ---: |")
    for kind in kinds:
        extra: Any = statistics.median(t - n for t, n in zip(times[kind], times["none"], strict=True))
        print(
            f"| {kind} | {statistics.median(times[kind]):.1f} | {min(times[kind]):.1f} | "
            f"{'-' if kind == 'none' else f'{extra:+.1f} us'} |"
        )


if __name__ == "__main__":
    main()
