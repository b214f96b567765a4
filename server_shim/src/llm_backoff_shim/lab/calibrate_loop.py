"""Calibrate's closed loop (I/O): workers that each keep one request in flight, and one level's
measurement on it.

The loop runs for the whole sweep: moving to another level adds workers (their first
requests start together) or cancels the extra ones (their streams close, so the engine
aborts them); the other workers' requests carry on. :func:`measure_level` then waits out
the ramp-in (:mod:`~llm_backoff_shim.lab.calibrate_plan`: as many completions as the level
has workers) and counts the window's completions, and returns what
:func:`~llm_backoff_shim.lab.calibrate_samples.summarize` needs: the requests that overlap
the window, the running ones included, and the window's bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .calibrate_plan import Sizing
from .calibrate_samples import Sample


@dataclass
class Live:
    """A request in flight: when it started, what it costs, its chunks' arrival times so far."""

    worker: int
    seq: int
    start: float
    cost: int
    token_times: list[float] = field(default_factory=list)

    def snapshot(self, now: float) -> Sample:
        first = self.token_times[0] if self.token_times else None
        return Sample(
            self.worker,
            self.seq,
            self.start,
            now,
            True,
            first_token=first,
            output_tokens=len(self.token_times),
            cost=self.cost,
            token_times=tuple(self.token_times),
            done=False,
        )


#: Sends one request: (worker, seq, the registry of live requests) -> its sample.
Send = Callable[[int, int, "dict[tuple[int, int], Live]"], Awaitable[Sample]]


class ClosedLoop:
    """``concurrency`` workers, each sending its next request when the last one ends."""

    def __init__(self, send: Send, clock: Callable[[], float]) -> None:
        self._send = send
        self.clock = clock
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self.live: dict[tuple[int, int], Live] = {}
        self.finished: list[Sample] = []
        self._ended = asyncio.Event()

    @property
    def concurrency(self) -> int:
        return len(self._tasks)

    def set_concurrency(self, level: int) -> None:
        """Start workers up to ``level``, or cancel those above it (their requests abort)."""
        for index in range(len(self._tasks), level):
            self._tasks[index] = asyncio.create_task(self._worker(index))
        for index in sorted(self._tasks, reverse=True):
            if index < level:
                break
            self._tasks.pop(index).cancel()

    async def _worker(self, index: int) -> None:
        seq = 0
        while True:
            sample = await self._send(index, seq, self.live)
            self.finished.append(sample)
            self._ended.set()
            seq += 1

    async def wait_until(self, ready: Callable[[], bool], deadline: float) -> None:
        """Return once ``ready()`` holds (checked at each completion and every 50 ms);
        ``TimeoutError`` at ``deadline``."""
        while not ready():
            left = deadline - self.clock()
            if left <= 0:
                raise TimeoutError
            self._ended.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ended.wait(), timeout=min(left, 0.05))

    def overlapping(self, low: float, high: float) -> list[Sample]:
        """Finished requests that overlap ``(low, high]``, and the running ones as of ``high``."""
        done = [s for s in self.finished if s.end > low and s.start < high]
        return done + [live.snapshot(high) for live in self.live.values()]

    async def close(self) -> None:
        """Cancel every worker; their streams close, so the upstream aborts what they ran."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class Measured:
    """One level's measurement: the requests that overlap its window, and its times."""

    level: int
    samples: list[Sample]
    level_start: float
    window: tuple[float, float]
    completions: int
    target: int


async def measure_level(loop: ClosedLoop, level: int, sizing: Sizing, deadline: float) -> Measured:
    """Set the loop to ``level``, wait out its ramp-in (when the level changed), then count
    ``sizing.completions(level)`` completions over at least ``sizing.min_seconds``.
    ``TimeoutError`` at ``deadline``."""
    clock = loop.clock
    level_start = clock()
    turnover = loop.concurrency != level
    loop.set_concurrency(level)
    if turnover:
        ramp_end = len(loop.finished) + level
        await loop.wait_until(lambda: len(loop.finished) >= ramp_end, deadline)
        low = loop.finished[ramp_end - 1].end
    else:
        low = level_start
    counted_from = len(loop.finished)
    target = sizing.completions(level)

    def enough() -> bool:
        return len(loop.finished) - counted_from >= target and clock() >= low + sizing.min_seconds

    await loop.wait_until(enough, deadline)
    high = clock()
    return Measured(
        level,
        loop.overlapping(low, high),
        level_start,
        (low, high),
        len(loop.finished) - counted_from,
        target,
    )
