"""The engine's own queue while calibrate measures: its ``/metrics`` sampled during the sweep.

vLLM (and the simulator) export ``vllm:num_requests_waiting`` and ``vllm:num_requests_running``.
Past the engine's slots a closed loop's extra requests wait *inside* the engine, where the
shim's classes do not count: an interactive request admitted behind them waits like a batch
one. :class:`EngineGauges` reads both gauges every :data:`INTERVAL` seconds for the whole
sweep; :func:`window_medians` gives a level's steady window their medians, which the knee rule
(:mod:`~llm_backoff_shim.lab.knee`, rule 1b) uses to refuse, as the knee, a level at which the
engine kept a queue. An upstream without the gauges (not vLLM-compatible, or ``/metrics``
behind another port) is judged by the SLOs alone, and calibrate says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import Awaitable, Callable, Sequence

import aiohttp

from .loadgen_engine import RUNNING, WAITING, metric_sum

#: Seconds between two reads of the engine's ``/metrics``: five per second put a dozen samples
#: or more in every steady window (at least 3 s by default), at a few milliseconds of the
#: engine's API server each.
INTERVAL = 0.2

#: One read: (clock, waiting, running); running None when the engine does not export it.
Reading = tuple[float, float, float | None]


def parse_gauges(text: str) -> tuple[float, float | None] | None:
    """(waiting, running) summed over label sets, from Prometheus text; None without ``waiting``."""
    waiting = metric_sum(text, WAITING)
    if waiting is None:
        return None
    return waiting, metric_sum(text, RUNNING)


def window_medians(readings: Sequence[Reading], low: float, high: float) -> tuple[float | None, float | None]:
    """Medians of the waiting and running gauges read in ``(low, high]`` (None: no reading)."""
    inside = [r for r in readings if low < r[0] <= high]
    if not inside:
        return None, None
    running = [r[2] for r in inside if r[2] is not None]
    return (
        float(statistics.median(r[1] for r in inside)),
        float(statistics.median(running)) if running else None,
    )


def metrics_fetch(
    session: aiohttp.ClientSession, url: str, api_key: str
) -> Callable[[], Awaitable[str | None]]:
    """Reads ``url`` (the engine's ``/metrics``) through ``session``; None on any failure."""
    headers = {"Authorization": f"Bearer {api_key}"}

    async def fetch() -> str | None:
        try:
            async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                if resp.status != 200:
                    return None
                return await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
            return None

    return fetch


class EngineGauges:
    """Reads the engine's queue gauges every ``interval`` seconds while the sweep runs.

    ``fetch`` returns the ``/metrics`` text, or None when it cannot be read (a missed read is a
    gap, not a failure)."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[str | None]],
        clock: Callable[[], float],
        interval: float = INTERVAL,
    ) -> None:
        self._fetch = fetch
        self._clock = clock
        self._interval = interval
        self.readings: list[Reading] = []
        self._task: asyncio.Task[None] | None = None

    async def read(self) -> bool:
        """One read; False when the engine's metrics have no ``vllm:num_requests_waiting``."""
        text = await self._fetch()
        gauges = None if text is None else parse_gauges(text)
        if gauges is None:
            return False
        self.readings.append((self._clock(), gauges[0], gauges[1]))
        return True

    async def start(self) -> bool:
        """Read once; when the gauges are there, keep reading in the background. Whether they are."""
        if not await self.read():
            return False
        self._task = asyncio.create_task(self._loop())
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.read()

    def window(self, low: float, high: float) -> tuple[float | None, float | None]:
        return window_medians(self.readings, low, high)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
