"""The engine's metrics, scraped: :class:`EngineWatch` feeds the pure saturation detector.

The shim's concurrency cap is a guess about the engine; the engine's own metrics are
the truth. In the spirit of llm-d's saturation detector, :class:`EngineWatch`
scrapes the upstream's Prometheus ``/metrics`` every few hundred milliseconds
(:func:`parse_engine_metrics`) and hands each sample to
:class:`~llm_backoff_shim.decide.saturation.SaturationDetector`, which decides (its module
says how); a scrape that fails leaves the detector to go stale. Whenever the detector's hold
flips, the watch wakes the queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from llm_backoff_shim.decide.saturation import EngineSample, SaturationDetector

Clock = Callable[[], float]

log = logging.getLogger("llm_backoff_shim.engine_watch")

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def parse_engine_metrics(text: str) -> EngineSample:
    """The engine's waiting/running counts and KV-cache usage from Prometheus text.

    Raises ValueError when the text is not Prometheus exposition or lacks
    ``vllm:num_requests_waiting`` (not a vLLM-compatible engine).
    """
    waiting: float | None = None
    running = 0.0
    kv: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            value = float(sample.value)
            if not math.isfinite(value):
                continue
            if sample.name == WAITING:
                waiting = (waiting or 0.0) + value
            elif sample.name == RUNNING:
                running += value
            elif sample.name in KV_CACHE:
                kv = value if kv is None else max(kv, value)
    if waiting is None:
        raise ValueError(f"no {WAITING} in the engine's metrics")
    return EngineSample(waiting, running, kv)


class EngineWatch:
    """The asyncio task that scrapes the engine and wakes the queues when it recovers."""

    def __init__(
        self,
        detector: SaturationDetector,
        *,
        url: str,
        session: Callable[[], aiohttp.ClientSession],
        interval: float,
        on_change: Callable[[], None],
    ) -> None:
        self.detector = detector
        self.url = url
        self._session = session
        self._interval = interval
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None
        self.scrapes = 0
        self.failures = 0

    async def scrape_once(self) -> None:
        before = self.detector.hold(None)
        then = self.detector.in_flight_now()
        timeout = aiohttp.ClientTimeout(
            total=max(0.05, min(self._interval * 4, self.detector.config.stale_after))
        )
        try:
            async with self._session().get(self.url, timeout=timeout, allow_redirects=False) as response:
                text = await response.text()
                if response.status != 200:
                    raise ValueError(f"engine metrics answered {response.status}")
            self.detector.observe(parse_engine_metrics(text), then)
            self.scrapes += 1
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            self.failures += 1
            log.debug("engine metrics scrape failed: %s", exc)
        # Staleness can also end a saturation: wake the queues whenever the verdict flips.
        if self.detector.hold(None) != before:
            self._on_change()

    async def _run(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def engine_metric_gauges(detector: SaturationDetector) -> Iterable[tuple[str, str, float]]:
    """(name, help, value) of the shim's view of the engine, for the shim's /metrics."""
    last = detector.last
    yield (
        "engine_saturated",
        "1 while the engine's own metrics say it is saturated",
        float(detector.saturated()),
    )
    yield (
        "engine_metrics_stale",
        "1 while the engine's metrics are missing or too old",
        float(detector.stale()),
    )
    if last is not None:
        yield ("engine_waiting", "Requests waiting in the engine (last scrape)", last.waiting)
        yield ("engine_running", "Requests running in the engine (last scrape)", last.running)
