"""The load generator's view of the engine: its queue while a run goes on, its token counts after.

Two kinds of engine, told apart on the first request:

- the project's simulator answers ``POST /sim/reset`` (its accounting restarts at zero)
  and ``GET /sim/stats`` (running, waiting, tokens generated, tokens generated for
  callers who had gone: ``aborted_tokens``);
- any other engine (vLLM) is read from its Prometheus ``/metrics``: the gauges
  ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` and the counter
  ``vllm:generation_tokens_total``, summed over label sets. Its tokens generated over the
  run are the counter's growth; the wasted ones are those not delivered in a completed
  answer (``tokens_generated - delivered``), which is what a caller who left cost it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of ``name`` in a Prometheus text exposition; None if absent."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest[:1] not in ("{", " "):
            continue  # a longer name with this prefix
        value = rest.rsplit("}", 1)[-1].split()
        if not value:
            continue
        try:
            number = float(value[0])
        except ValueError:
            continue
        if math.isfinite(number):
            total += number
            found = True
    return total if found else None


class EngineProbe:
    """Reads one engine's occupancy and token counters through an HTTP client (httpx-like)."""

    def __init__(self, client: Any, engine_url: str) -> None:
        self._client = client
        self._url = engine_url.rstrip("/")
        self.is_sim: bool | None = None
        self._baseline: dict[str, float] = {}

    async def get_json(self, url: str) -> dict[str, Any] | None:
        try:
            response = await self._client.get(url)
            if response.status_code != 200:
                return None
            data = response.json()
        except Exception:
            # A missed sample is a gap in a plot, not a reason to abort the run.
            return None
        return data if isinstance(data, dict) else None

    async def _metrics(self) -> str | None:
        try:
            response = await self._client.get(self._url + "/metrics")
        except Exception:
            return None
        return response.text if response.status_code == 200 else None

    async def reset(self) -> None:
        """Zero the simulator's accounting, or note a vLLM's counters as the run's baseline."""
        response = await self._client.post(self._url + "/sim/reset")
        if response.status_code < 400:
            self.is_sim = True
            return
        self.is_sim = False
        text = await self._metrics()
        if text is None:
            raise RuntimeError(f"{self._url} has neither /sim/reset nor /metrics")
        for name in (GENERATED, PREEMPTIONS):
            self._baseline[name] = metric_sum(text, name) or 0.0

    async def occupancy(self) -> tuple[int | None, int | None]:
        """(running, waiting) requests in the engine now; None where unknown."""
        if self.is_sim is not False:
            stats = await self.get_json(self._url + "/sim/stats")
            if stats is None:
                return None, None
            return int(stats["running"]), int(stats["waiting"])
        text = await self._metrics()
        if text is None:
            return None, None
        running, waiting = metric_sum(text, RUNNING), metric_sum(text, WAITING)
        return (
            None if running is None else int(running),
            None if waiting is None else int(waiting),
        )

    async def settled_stats(self, delivered: int, timeout: float = 5.0) -> dict[str, Any]:
        """The engine's accounting of the run once the callers' disconnects have reached it.

        ``delivered``: answer tokens of the calls that completed (for a non-simulator engine,
        the rest of what it generated counts as wasted).
        """
        end = time.monotonic() + timeout
        while True:
            running, waiting = await self.occupancy()
            if (running == 0 and waiting == 0) or time.monotonic() > end:
                break
            await asyncio.sleep(0.1)
        if self.is_sim is not False:
            return await self.get_json(self._url + "/sim/stats") or {}
        text = await self._metrics() or ""
        generated = int((metric_sum(text, GENERATED) or 0.0) - self._baseline.get(GENERATED, 0.0))
        preempted = int((metric_sum(text, PREEMPTIONS) or 0.0) - self._baseline.get(PREEMPTIONS, 0.0))
        return {
            "running": running,
            "waiting": waiting,
            "tokens_generated": generated,
            "aborted_tokens": max(0, generated - delivered),
            "preemptions": preempted,
        }


#: Numeric fields of the simulator's ``/sim/stats`` that add up across engines.
_SUMMED = ("tokens_generated", "aborted_tokens", "preemptions", "running", "waiting")


class FleetProbe:
    """Several engines behind one address (a fleet), read as one: occupancy and token counts
    summed over :class:`EngineProbe` s; :attr:`last` keeps each engine's (running, waiting)
    of the latest :meth:`occupancy`, in the order of ``engine_urls``."""

    def __init__(self, client: Any, engine_urls: Sequence[str]) -> None:
        if not engine_urls:
            raise ValueError("a fleet probe needs at least one engine")
        self.probes = [EngineProbe(client, url) for url in engine_urls]
        self.last: list[tuple[int | None, int | None]] = []

    async def get_json(self, url: str) -> dict[str, Any] | None:
        return await self.probes[0].get_json(url)

    async def reset(self) -> None:
        await asyncio.gather(*(p.reset() for p in self.probes))

    async def occupancy(self) -> tuple[int | None, int | None]:
        """Running and waiting summed over the engines; None where any engine's is unknown."""
        self.last = list(await asyncio.gather(*(p.occupancy() for p in self.probes)))
        running = [r for r, _w in self.last]
        waiting = [w for _r, w in self.last]
        return (
            None if None in running else sum(r for r in running if r is not None),
            None if None in waiting else sum(w for w in waiting if w is not None),
        )

    async def settled_stats(self, delivered: int, timeout: float = 5.0) -> dict[str, Any]:
        """The engines' accounting summed (:meth:`EngineProbe.settled_stats`); for engines other
        than the simulator, what no completed call received counts as wasted, over all of them."""
        each = await asyncio.gather(*(p.settled_stats(0, timeout) for p in self.probes))
        total: dict[str, Any] = {
            key: sum(int(stats.get(key) or 0) for stats in each)
            for key in _SUMMED
            if any(key in s for s in each)
        }
        if any(p.is_sim is False for p in self.probes):
            total["aborted_tokens"] = max(0, int(total.get("tokens_generated", 0)) - delivered)
        total["engines"] = list(each)
        return total
