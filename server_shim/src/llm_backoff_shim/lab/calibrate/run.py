"""One calibrate run (I/O): its settings, the probe, the plan, the closed loop and its requests,
and the engine's gauges.

**The plan.** How long calibrate measures each level, and how long the sweep will take (pure).

A level is sized by the engine's own request duration, not by a number of seconds:

- **Ramp-in.** When the concurrency changes, the level first waits for as many requests
  to end as it has workers (one turnover: every slot's request, on average, was replaced
  by one started at this level, about one request's duration). The requests carried in
  from the level before and the burst that new workers start together end inside it.
- **Window.** Then it counts :meth:`Sizing.completions` completions: two per slot, at
  least 20, but never more than six request durations' worth (at concurrency 1, six
  requests). Two per slot: every slot turned over twice inside the window, so the lengths
  in flight are the mix's steady ones and a request that outlasts the others still ends
  inside it. At least 20: the p99 TTFT of 20 requests lies between the two slowest, and
  the answer tokens/s over the window (counted token by token) varies by a few percent
  between repeats. At most six durations: low levels, which rarely hold the knee, would
  otherwise cost 20 durations each on a slow engine. The window also lasts at least
  ``min_seconds`` (``--step-seconds``): a machine's hiccup of a few hundred
  milliseconds should not be a tenth of a fast engine's window. At most ``cap``
  (``--step-requests``) completions.

A measurement therefore takes ``1 + completions / level`` request durations (the ramp-in
only when the level changed). The sweep's plan (:func:`plan_sweep`) estimates the whole
run at the duration a probe measured at concurrency 1 and, when it does not fit in
``--max-seconds``, cuts in this order: coarser steps (:data:`COARSE`: one per slot, at
least 10, at most three durations), then fewer repeats (two per level), then fewer levels
(every other level of the ramp; the refinement between two levels narrows the knee
afterwards). Requests slow down as the batch fills, so the estimate is a floor; the
ramp re-estimates each measurement from the durations measured so far
(:func:`measurement_seconds`) and stops, saying so, when the next one does not fit.

**The engine's queue.** The engine's own queue while calibrate measures: its ``/metrics``
sampled during the sweep.

vLLM (and the simulator) export ``vllm:num_requests_waiting`` and ``vllm:num_requests_running``.
Past the engine's slots a closed loop's extra requests wait *inside* the engine, where the
shim's classes do not count: an interactive request admitted behind them waits like a batch
one. :class:`EngineGauges` reads both gauges every :data:`INTERVAL` seconds for the whole
sweep; :func:`window_medians` gives a level's steady window their medians, which the knee rule
(:mod:`~llm_backoff_shim.lab.calibrate.measure`, rule 1b) uses to refuse, as the knee, a level
at which the engine kept a queue. An upstream without the gauges (not vLLM-compatible, or ``/metrics``
behind another port) is judged by the SLOs alone, and calibrate says so.

**The closed loop.** Workers that each keep one request in flight, and one level's
measurement on it.

The loop runs for the whole sweep: moving to another level adds workers (their first
requests start together) or cancels the extra ones (their streams close, so the engine
aborts them); the other workers' requests carry on. :func:`measure_level` then waits out
the ramp-in (the plan, above: as many completions as the level
has workers) and counts the window's completions, and returns what
:func:`~llm_backoff_shim.lab.calibrate.measure.summarize` needs: the requests that overlap
the window, the running ones included, and the window's bounds.

**The requests.** Streamed chat completions of the mix, timed chunk by chunk.

:class:`Driver` sends the probe and the closed loop's requests
(the closed loop, above) through one ``AsyncOpenAI`` client, each
registered as :class:`Live` while it runs, and returns
a :class:`~llm_backoff_shim.lab.calibrate.measure.Sample` when it ends or fails.

**The run.** Its settings, the probe, the plan and the measurement loop over the levels.

:func:`run_ramp` probes one request (:class:`Driver`),
prints the plan (:func:`plan_sweep`), measures the levels
:func:`~llm_backoff_shim.lab.calibrate.measure.next_level` asks for on one closed loop
(:class:`ClosedLoop`) within the run's time cap, and returns an
:class:`Outcome` for :mod:`llm_backoff_shim.lab.calibrate.report`. The command and its
flags are :mod:`llm_backoff_shim.lab.calibrate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import openai

from ..loadgen_engine import RUNNING, WAITING, metric_sum
from ..workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, LengthDist, prompt_text
from .history import RunRecord
from .measure import (
    BATCH_QUEUE_WAIT,
    Confidence,
    CostMeter,
    Knee,
    KneeRule,
    Recommendation,
    Sample,
    SlotCost,
    StepStats,
    budget_tokens,
    find_knee,
    next_level,
    recommend,
    slot_cost,
    summarize,
    with_confidence,
)

# -- the plan ------------------------------------------------------------------------------


def settle_measurements(repeats: int) -> int:
    """Measurements beyond the climb a typical run takes to settle: one refinement between
    the knee and a level over the SLO, the level above the knee measured once more and the
    knee itself up to ``repeats`` times."""
    return repeats + 1


@dataclass(frozen=True)
class Sizing:
    """How many completions a level's window counts (see the module doc)."""

    per_slot: int = 2
    minimum: int = 20
    max_durations: float = 6.0
    cap: int = 1000
    min_seconds: float = 3.0

    def __post_init__(self) -> None:
        if self.per_slot < 1 or self.minimum < 1 or self.cap < 1:
            raise ValueError(f"per_slot, minimum and cap must be >= 1, got {self}")
        if not (math.isfinite(self.max_durations) and self.max_durations >= 1):
            raise ValueError(f"max_durations must be >= 1, got {self.max_durations!r}")
        if not (math.isfinite(self.min_seconds) and self.min_seconds >= 0):
            raise ValueError(f"min_seconds must be >= 0, got {self.min_seconds!r}")

    def completions(self, level: int) -> int:
        """Completions the window of ``level`` counts."""
        wanted = max(self.per_slot * level, self.minimum)
        wanted = min(wanted, math.floor(self.max_durations * level))
        return max(1, min(wanted, self.cap))

    def window_durations(self, level: int) -> float:
        """The window's length in request durations: ``level`` requests end per duration."""
        return self.completions(level) / level

    def describe(self) -> str:
        return (
            f"{self.per_slot} completions per slot, at least {self.minimum}, at most "
            f"{self.max_durations:g} request durations and {self.cap} completions, at least "
            f"{self.min_seconds:g} s"
        )


def coarse(sizing: Sizing) -> Sizing:
    """The coarser steps a plan falls back to when the full one does not fit (module doc)."""
    return replace(
        sizing,
        per_slot=1,
        minimum=max(1, min(sizing.minimum, 10)),
        max_durations=min(sizing.max_durations, 3.0),
    )


COARSE = coarse(Sizing())


def measurement_seconds(sizing: Sizing, level: int, duration: float, *, turnover: bool = True) -> float:
    """Seconds one measurement of ``level`` takes when a request lasts ``duration`` s there."""
    window = max(sizing.min_seconds, sizing.window_durations(level) * duration)
    return (duration if turnover else 0.0) + window


def sweep_seconds(levels: Sequence[int], sizing: Sizing, duration: float, settle: int) -> float:
    """A sweep climbing every level of ``levels`` then taking ``settle`` more measurements
    (each at the cost of the top level), at ``duration`` s per request."""
    climb = sum(measurement_seconds(sizing, level, duration) for level in levels)
    top = measurement_seconds(sizing, levels[-1], duration) if levels else 0.0
    return climb + settle * top


def thin(levels: Sequence[int]) -> tuple[int, ...]:
    """Every other level of a ramp, keeping its first and last: 1,2,4,8,16 -> 1,4,16."""
    kept = list(levels[::2])
    if levels and kept[-1] != levels[-1]:
        kept.append(levels[-1])
    return tuple(kept)


@dataclass(frozen=True)
class SweepPlan:
    """The sweep calibrate will run: its levels, repeats and sizing, its estimated length,
    and what was cut to fit ``--max-seconds`` (``fits`` False: even cut, it may not)."""

    levels: tuple[int, ...]
    repeats: int
    sizing: Sizing
    duration: float
    seconds: float
    full_seconds: float
    max_seconds: float
    cuts: tuple[str, ...] = ()
    fits: bool = True


def plan_sweep(
    levels: Sequence[int], repeats: int, sizing: Sizing, duration: float, max_seconds: float
) -> SweepPlan:
    """The plan for a sweep whose requests last ``duration`` s (the probe's), cut to fit
    ``max_seconds`` in the order of the module doc."""
    if not levels:
        raise ValueError("no level to plan")
    if not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"duration must be a positive number of seconds, got {duration!r}")

    ramp = tuple(levels)
    full = sweep_seconds(ramp, sizing, duration, settle_measurements(repeats))
    cuts: list[str] = []
    reps = repeats

    def cost() -> float:
        return sweep_seconds(ramp, sizing, duration, settle_measurements(reps))

    if cost() > max_seconds and coarse(sizing) != sizing:
        sizing = coarse(sizing)
        cuts.append(f"coarser steps ({sizing.describe()})")
    if cost() > max_seconds and reps > 2:
        reps = 2
        cuts.append("2 measurements per level next to the knee")
    if cost() > max_seconds and len(ramp) > 2:
        while cost() > max_seconds and len(thin(ramp)) < len(ramp):
            ramp = thin(ramp)
        cuts.append(f"fewer levels ({','.join(map(str, ramp))})")
    seconds = cost()
    return SweepPlan(
        levels=ramp,
        repeats=reps,
        sizing=sizing,
        duration=duration,
        seconds=seconds,
        full_seconds=full,
        max_seconds=max_seconds,
        cuts=tuple(cuts),
        fits=seconds <= max_seconds,
    )


def duration_text(seconds: float) -> str:
    """``"45 s"``, ``"10 min"``, ``"2.5 h"``: a length of time for people."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f}".removesuffix(".0") + " min"
    return f"{seconds / 3600:.1f}".removesuffix(".0") + " h"


def plan_lines(plan: SweepPlan, probe: str) -> list[str]:
    """What calibrate prints once the probe has measured a request, before the sweep."""
    lines = [
        f"plan: {probe}; each level waits for one request per slot to end (ramp-in), then counts "
        f"{plan.sizing.describe()}",
        f"plan: levels {','.join(map(str, plan.levels))}, then up to {plan.repeats} measurements of the "
        f"levels next to the knee: about {duration_text(plan.seconds)} at the probe's pace if it climbs "
        "to the top (it stops at the knee; requests slow as the batch fills, and each level re-estimates)",
    ]
    if plan.cuts:
        lines.append(
            f"plan: the full sweep would take about {duration_text(plan.full_seconds)}, over the "
            f"{duration_text(plan.max_seconds)} --max-seconds leaves: cut to " + "; ".join(plan.cuts)
        )
    if not plan.fits:
        lines.append(
            f"plan: still over the {duration_text(plan.max_seconds)} --max-seconds leaves: the sweep stops "
            "when the next measurement does not fit, and recommends from what it measured"
        )
    elif not plan.cuts:
        lines.append(f"plan: within the {duration_text(plan.max_seconds)} --max-seconds leaves")
    return lines


def expected_duration(
    level: int, probe: float, runs: Mapping[int, Sequence[StepStats]], *, full: bool = True
) -> float:
    """How long a request will take at ``level``: the mean latency measured at the highest
    level at or below it (the probe's before any) and, with ``full``, no less than ``level``
    over the best rate measured so far (Little's law: were the engine already full, requests
    would queue in it)."""
    below = [lvl for lvl in runs if lvl <= level and any(s.mean_latency > 0 for s in runs[lvl])]
    latency = probe
    if below:
        latency = max(s.mean_latency for s in runs[max(below)])
    best = max((s.throughput for steps in runs.values() for s in steps), default=0.0)
    if full and best > 0:
        latency = max(latency, level / best)
    return latency


def time_to_go(
    levels: Sequence[int],
    repeats: int,
    sizing: Sizing,
    probe: float,
    runs: Mapping[int, Sequence[StepStats]],
    settled: int | None = None,
    *,
    full: bool = True,
) -> float:
    """Seconds the rest of a sweep takes, each request lasting as :func:`expected_duration`
    says from what was measured (``full``: as if the engine were already full, the most it
    can take; else at the pace of the highest level measured): while climbing (``settled``
    None), every level not yet measured and then the settling; once the climb is over, the
    settling measurements not yet taken (``settled`` of them were), at the cost of the
    highest level measured."""
    top = max(runs, default=0)
    ahead = [level for level in levels if level > top] if settled is None else []

    def cost(level: int) -> float:
        return measurement_seconds(sizing, level, expected_duration(level, probe, runs, full=full))

    seconds = sum(cost(level) for level in ahead)
    last = ahead[-1] if ahead else top
    each = cost(last) if last else 0.0
    return seconds + max(0, settle_measurements(repeats) - (settled or 0)) * each


# -- the engine's queue --------------------------------------------------------------------

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


# -- the closed loop -----------------------------------------------------------------------


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


# -- the requests --------------------------------------------------------------------------


def _has_content(delta: Any) -> bool:
    if delta is None:
        return False
    # vLLM streams reasoning models' thinking in reasoning_content (older) or reasoning.
    return any(
        getattr(delta, name, None) for name in ("content", "reasoning_content", "reasoning", "tool_calls")
    )


def error_text(exc: BaseException) -> str:
    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {exc.message}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def streaming_http_client(pool: int) -> Any:
    """The SDK's default async HTTP client with a pool wide enough for ``pool`` streams.

    openai's default keeps 100 idle connections; above that, each new request would
    pay a TCP connect inside its measured TTFT. openai 3.x runs on httpx2, 2.x on httpx.
    """
    if int(openai.__version__.split(".")[0]) >= 3:
        import httpx2 as httplib
    else:  # pragma: no cover - exercised by the openai 2.x environment
        import httpx as httplib  # type: ignore[no-redef]
    limits = httplib.Limits(max_connections=pool + 16, max_keepalive_connections=pool + 16)
    return openai.DefaultAsyncHttpxClient(limits=limits)


@dataclass
class Driver:
    """Sends calibrate's requests through one ``AsyncOpenAI`` client, lengths drawn from the mix."""

    client: openai.AsyncOpenAI
    model: str
    config: CalibrateConfig
    clock: Callable[[], float]
    rng: random.Random = field(default_factory=random.Random)
    #: Prompt words sent and prompt tokens the upstream counted for them, so far: a running
    #: request's cost is estimated at this ratio until its own count arrives.
    words_sent: int = 0
    tokens_counted: int = 0
    #: Prices requests as the shim's cost cap does (:class:`CostMeter`); made from the mix.
    costs: CostMeter | None = None
    #: The prompt tokens of every completed request of the mix (the probe's aside), chat and
    #: long-prompt ones apart: what the cost budget's slots hold (:func:`slot_cost`).
    chat_prompts: list[int] = field(default_factory=list)
    long_prompts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.costs is None:
            self.costs = CostMeter(self.clock, round(self.config.output_tokens.mean()))

    def prompt_tokens(self, words: int) -> int:
        """The upstream's likely count for a prompt of ``words`` words."""
        if self.words_sent <= 0 or self.tokens_counted <= 0:
            return words
        return round(words * self.tokens_counted / self.words_sent)

    def draw(self) -> tuple[int, int, bool]:
        """One request's prompt words and ``max_tokens`` from the mix, and whether its prompt is
        a long one."""
        cfg = self.config
        long = cfg.long_share > 0 and self.rng.random() < cfg.long_share
        words = (cfg.long_prompt_words if long else cfg.prompt_words).draw(self.rng)
        return words, cfg.output_tokens.draw(self.rng), long

    async def probe(self) -> Sample:
        """One request of the mix's mean lengths, alone: how long a request takes."""
        words = max(1, round(self.config.mean_prompt_words()))
        max_tokens = max(1, round(self.config.output_tokens.mean()))
        return await self.one_request(0, -1, {}, lengths=(words, max_tokens, False))

    async def one_request(
        self,
        worker: int,
        seq: int,
        live: dict[tuple[int, int], Live],
        lengths: tuple[int, int, bool] | None = None,
    ) -> Sample:
        """One streamed request, registered in ``live`` while it runs (its chunks' times too);
        ``lengths``: its prompt words, ``max_tokens`` and whether it is a long-prompt one (the
        probe's), else drawn from the mix."""
        cfg = self.config
        words, max_tokens, long = lengths or self.draw()
        prompt = prompt_text(words, self.rng)
        extra: dict[str, object] = {"ignore_eos": True} if cfg.ignore_eos else {}
        start = self.clock()
        costs = self.costs
        assert costs is not None
        # Priced when it starts, as the shim prices at admission (measure.CostMeter).
        answer = costs.answer()
        running = Live(worker, seq, start, self.prompt_tokens(words) + answer)
        live[(worker, seq)] = running
        times = running.token_times
        usage: Any = None
        try:
            stream = await self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                temperature=0,
                extra_body=extra or None,
            )
            async with stream:
                async for chunk in stream:
                    now = self.clock()
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if any(_has_content(choice.delta) for choice in chunk.choices):
                        times.append(now)
        except Exception as exc:  # a load generator records any failure and carries on
            return Sample(
                worker, seq, start, self.clock(), ok=False, error=error_text(exc), cost=running.cost
            )
        finally:
            live.pop((worker, seq), None)
        end = self.clock()
        tokens = int(getattr(usage, "completion_tokens", 0) or len(times))
        prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
        if prompt_tokens:
            self.words_sent += words
            self.tokens_counted += prompt_tokens
        costs.observe(tokens)
        if seq >= 0:
            kind = self.long_prompts if long else self.chat_prompts
            kind.append(prompt_tokens or self.prompt_tokens(words))
        first = times[0] if times else None
        itl = None
        if first is not None and tokens >= 2 and times[-1] > first:
            itl = (times[-1] - first) / (tokens - 1)
        return Sample(
            worker,
            seq,
            start,
            end,
            ok=True,
            first_token=first,
            itl=itl,
            output_tokens=tokens,
            prompt_tokens=prompt_tokens,
            cost=(prompt_tokens or self.prompt_tokens(words)) + answer,
            token_times=tuple(times),
        )


# -- the run -------------------------------------------------------------------------------

#: Long prompts' length in words when ``--long-share`` is set without ``--long-prompt-words``:
#: the retrieval-augmented and agent calls of a mixed load, 1,400-2,900 tokens at the 1.3 tokens
#: a word of large vocabularies (2,750-5,500 at the 2.5 of small ones: the results print the
#: upstream's count; use shorter prompts for a model of a 4,096-token context).
DEFAULT_LONG_PROMPT_WORDS = LengthDist.uniform(1100, 2200)

PROG = "llm-backoff-shim calibrate"
DEFAULT_TTFT_SLO = 2.0
DEFAULT_TPOT_SLO = 0.1


class CalibrateError(Exception):
    """The run cannot go on (upstream unreachable, no model...); ``str()`` is one line for users."""


def api_base(upstream: str) -> tuple[str, str]:
    """``(openai base_url, shim --upstream)`` from a URL given with or without ``/v1``."""
    parts = urlsplit(upstream.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected an http(s) URL such as http://127.0.0.1:8000, got {upstream!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"expected a base URL without query or fragment, got {upstream!r}")
    path = parts.path.rstrip("/")
    root = path.removesuffix("/v1")
    base = f"{parts.scheme}://{parts.netloc}{root}"
    return base + "/v1", base


@dataclass(frozen=True)
class CalibrateConfig:
    """One run's validated settings, built from the flags by ``calibrate.config_from_args``."""

    upstream: str
    ttft_slo: float
    levels: tuple[int, ...]
    model: str | None = None
    api_key: str = "EMPTY"
    tpot_slo: float | None = DEFAULT_TPOT_SLO
    batch_queue_wait: float | None = BATCH_QUEUE_WAIT
    prompt_words: LengthDist = DEFAULT_PROMPT_WORDS
    output_tokens: LengthDist = DEFAULT_OUTPUT_TOKENS
    #: Share of requests whose prompt is drawn from ``long_prompt_words`` instead.
    long_share: float = 0.0
    long_prompt_words: LengthDist = DEFAULT_LONG_PROMPT_WORDS
    #: Shortest steady window (``--step-seconds``) and most completions counted per level.
    step_seconds: float = 3.0
    step_requests: int = 1000
    completions_per_slot: int = 2
    min_completions: int = 20
    max_seconds: float = 600.0
    request_timeout: float = 300.0
    ignore_eos: bool = True
    seed: int = 0
    max_error_ratio: float = 0.01
    repeats: int = 4
    tolerance: float = 0.05
    out: Path = Path(".")
    json: bool = False
    write_config: Path | None = None

    @property
    def max_measurements(self) -> int:
        """Most measurements a run takes: every level climbed once, the ones next to the knee
        repeated, a few refinements (the ramp stops earlier when the verdict is stable)."""
        return len(self.levels) + 4 * self.repeats + 2 * self.rule.refine

    @property
    def sizing(self) -> Sizing:
        return Sizing(
            per_slot=self.completions_per_slot,
            minimum=self.min_completions,
            cap=self.step_requests,
            min_seconds=self.step_seconds,
        )

    def mean_prompt_words(self) -> float:
        """The mix's mean prompt length in words (short and long prompts together)."""
        short = self.prompt_words.mean()
        if self.long_share <= 0:
            return short
        return (1 - self.long_share) * short + self.long_share * self.long_prompt_words.mean()

    def describe_mix(self) -> str:
        text = f"prompt {self.prompt_words} words"
        if self.long_share > 0:
            text += f" ({self.long_share:.0%} of them {self.long_prompt_words} words)"
        return text + f", output {self.output_tokens} tokens"

    @property
    def rule(self) -> KneeRule:
        return KneeRule(
            self.ttft_slo,
            self.tpot_slo,
            self.max_error_ratio,
            tolerance=self.tolerance,
            gain=self.tolerance,
            min_repeats=min(2, self.repeats),
            max_repeats=self.repeats,
            min_requests=max(1, min(self.min_completions, self.step_requests) // 2),
        )


# -- the ramp ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """A finished ramp: every measurement in the order taken (``steps``) and by level (``runs``)."""

    upstream: str
    model: str
    config: CalibrateConfig
    steps: list[StepStats]
    runs: dict[int, list[StepStats]]
    stopped: str
    first_errors: dict[int, str]
    knee: Knee
    confidence_reason: str
    recommendation: Recommendation | None
    png: Path | None = None
    plan: SweepPlan | None = None
    probe: Sample | None = None
    seconds: float = 0.0
    #: This run's own confidence and why, before it was judged across runs
    #: (:mod:`~llm_backoff_shim.lab.calibrate.history`); None until then.
    own_confidence: tuple[Confidence, str] | None = None
    #: The previous run of the same setup in ``--out`` (None: the first).
    previous_run: RunRecord | None = None
    #: One slot's cost over the mix, which sized the cost budget (None: no knee, or no request
    #: completed).
    slot_cost: SlotCost | None = None


def _progress_line(index: int, step: StepStats, seconds: float, first_error: str | None) -> str:
    line = (
        f"[{index}] concurrency {step.concurrency:>4}: {step.requests} ok, {step.errors} failed "
        f"in a {step.window:.1f} s window ({seconds:.1f} s with ramp-in) | {step.throughput:.2f} req/s, "
        f"{step.output_tokens_per_s:.0f} tok/s | TTFT p50 {step.ttft_p50:.3f} p99 {step.ttft_p99:.3f} s | "
        f"TPOT p99 {step.itl_p99 * 1000:.1f} ms | {step.mean_latency:.1f} s per request"
    )
    if step.engine_waiting is not None:
        running = "" if step.engine_running is None else f", {step.engine_running:g} running"
        line += f" | engine: {step.engine_waiting:g} waiting{running} (medians)"
    return line + (f" | first error: {first_error}" if first_error else "")


async def _pick_model(client: openai.AsyncOpenAI, upstream: str) -> str:
    try:
        page = await client.models.list()
    except Exception as exc:  # any failure here means the upstream is unusable as given
        raise CalibrateError(
            f"cannot list models at {upstream}: {error_text(exc)} (or pass --model)"
        ) from None
    ids = [m.id for m in page.data]
    if not ids:
        raise CalibrateError(f"{upstream}/v1/models lists no model; pass --model")
    return ids[0]


def _probe_text(sample: Sample) -> str:
    ttft = (sample.first_token or sample.end) - sample.start
    tpot = f", {sample.itl * 1000:.0f} ms per token" if sample.itl is not None else ""
    return (
        f"one request of the mix's mean lengths ({sample.output_tokens} tokens out) took "
        f"{sample.end - sample.start:.2f} s alone (TTFT {ttft:.2f} s{tpot})"
    )


async def run_ramp(
    config: CalibrateConfig,
    *,
    clock: Callable[[], float],
    progress: Callable[[str], None],
) -> Outcome:
    """Probe, plan, then measure levels as :func:`~llm_backoff_shim.lab.calibrate.measure.next_level` asks,
    within ``config.max_seconds``."""
    base_url, shim_upstream = api_base(config.upstream)
    began = clock()
    run_deadline = began + config.max_seconds
    client = openai.AsyncOpenAI(
        base_url=base_url,
        api_key=config.api_key,
        max_retries=0,  # measure the upstream, not the SDK's retries
        timeout=config.request_timeout,
        http_client=streaming_http_client(max(config.levels)),
    )
    async with client:
        if config.model:
            model = config.model
        else:
            # Inside the run's time cap too: a black-holed host must not hang the command.
            limit = min(config.request_timeout, config.max_seconds)
            try:
                model = await asyncio.wait_for(_pick_model(client, shim_upstream), timeout=limit)
            except asyncio.TimeoutError:
                raise CalibrateError(
                    f"{shim_upstream}/v1/models did not answer within {limit:g} s (or pass --model)"
                ) from None
        driver = Driver(client, model, config, clock, random.Random(config.seed))
        tpot = "off" if config.tpot_slo is None else f"{config.tpot_slo:g} s"
        progress(
            f"{PROG}: {shim_upstream} model {model!r}, {config.describe_mix()}, SLO p99 TTFT "
            f"{config.ttft_slo:g} s / TPOT {tpot}; probing one request to size the steps"
        )
        empty = Outcome(
            shim_upstream, model, config, [], {}, "", {}, find_knee({}, config.rule), "no knee", None
        )
        try:
            probe = await asyncio.wait_for(driver.probe(), timeout=max(0.0, run_deadline - clock()))
        except asyncio.TimeoutError:
            empty.stopped = f"--max-seconds {config.max_seconds:g} reached during the probe"
            empty.seconds = clock() - began
            return empty
        if not probe.ok:
            progress(f"{PROG}: the probe request failed: {probe.error}")
            empty.stopped = f"the probe failed: {probe.error}"
            empty.first_errors[1] = probe.error or "failed"
            empty.probe = probe
            empty.seconds = clock() - began
            return empty
        plan = plan_sweep(
            config.levels,
            config.repeats,
            config.sizing,
            probe.end - probe.start,
            max(0.0, run_deadline - clock()),
        )
        for line in plan_lines(plan, _probe_text(probe)):
            progress(line)
        async with aiohttp.ClientSession() as session:
            metrics = f"{shim_upstream}/metrics"
            gauges = EngineGauges(metrics_fetch(session, metrics, config.api_key), clock)
            if await gauges.start():
                progress(
                    f"engine: reading vllm:num_requests_waiting and _running at {metrics} every "
                    f"{INTERVAL:g} s; a level at which the engine keeps requests waiting is not a knee"
                )
            else:
                progress(
                    f"engine: no vllm:num_requests_waiting at {metrics}: the SLOs alone judge the levels "
                    "(a knee may then keep requests waiting inside the engine, where classes do not count)"
                )
            try:
                outcome = await _sweep(driver, config, plan, probe, run_deadline, progress, gauges)
            finally:
                await gauges.close()
    outcome.upstream, outcome.model, outcome.seconds = shim_upstream, model, clock() - began
    return outcome


async def _sweep(
    driver: Driver,
    config: CalibrateConfig,
    plan: SweepPlan,
    probe: Sample,
    run_deadline: float,
    progress: Callable[[str], None],
    gauges: EngineGauges | None = None,
) -> Outcome:
    clock = driver.clock
    rule = replace(
        config.rule, max_repeats=plan.repeats, min_repeats=min(config.rule.min_repeats, plan.repeats)
    )
    loop = ClosedLoop(driver.one_request, clock)
    steps: list[StepStats] = []
    runs: dict[int, list[StepStats]] = {}
    history: list[int | None] = []
    first_errors: dict[int, str] = {}
    stopped = "all levels measured"
    sizing = plan.sizing
    duration = probe.end - probe.start
    settled: int | None = None  # measurements since the climb ended
    try:
        for index in range(1, config.max_measurements + 1):
            step_plan = next_level(runs, plan.levels, rule, history)
            if step_plan.level is None:
                stopped = step_plan.purpose
                break
            level = step_plan.level
            remaining = run_deadline - clock()
            expected = expected_duration(level, duration, runs)
            turnover = loop.concurrency != level
            need = measurement_seconds(sizing, level, expected, turnover=turnover)
            if need > remaining and sizing != coarse(sizing):
                sizing = coarse(sizing)
                progress(f"[{index}] coarser steps from here on to fit --max-seconds: {sizing.describe()}")
                need = measurement_seconds(sizing, level, expected, turnover=turnover)
            if need > remaining:
                stopped = (
                    f"--max-seconds {config.max_seconds:g}: {remaining:.0f} s left, concurrency {level} "
                    f"({step_plan.purpose}) needs about {need:.0f} s"
                )
                break
            progress(
                f"[{index}] concurrency {level:>4} ({step_plan.purpose}): "
                f"{'ramp-in, then ' if turnover else ''}{sizing.completions(level)} completions, about "
                f"{need:.0f} s at {expected:.1f} s per request; {remaining:.0f} s left"
            )
            began = clock()
            try:
                measured = await measure_level(loop, level, sizing, run_deadline)
            except TimeoutError:
                stopped = f"--max-seconds {config.max_seconds:g} reached during concurrency {level}"
                progress(f"[{index}] concurrency {level:>4}: cut by --max-seconds; not counted")
                break
            step = summarize(
                level, measured.samples, level_start=measured.level_start, window=measured.window
            )
            low, high = measured.window
            if gauges is not None:
                waiting, running = gauges.window(low, high)
                step = replace(step, engine_waiting=waiting, engine_running=running)
            error = next((s.error for s in measured.samples if s.error and low < s.end <= high), None)
            if error:
                first_errors.setdefault(level, error)
            steps.append(step)
            runs.setdefault(level, []).append(step)
            history.append(find_knee(runs, rule).level)
            if step_plan.purpose != "climb" and settled is None:
                settled = 0
            if settled is not None:
                settled += 1
            fast = time_to_go(plan.levels, plan.repeats, sizing, duration, runs, settled, full=False)
            slow = time_to_go(plan.levels, plan.repeats, sizing, duration, runs, settled)
            to_go = f"about {duration_text(fast)} to go at this pace"
            if slow - fast >= 60:
                to_go += f", {duration_text(slow)} if the engine is already full"
            progress(f"{_progress_line(index, step, clock() - began, error)} | {to_go}")
            if all(s.requests == 0 for s in steps):
                stopped = f"every request failed at concurrency {level}"
                break
        else:
            stopped = "measurement budget used up"
    finally:
        await loop.close()
    knee, why = with_confidence(find_knee(runs, rule), history, rule)
    rec = None
    per_slot: SlotCost | None = None
    if knee.level is not None:
        at_knee = runs[knee.level]
        # The budget: what the knee's slots of the mix hold 95 % of the time, from every request of
        # the run (measure.py, the cost), not the few long prompts of the knee's own windows.
        costs = driver.costs
        assert costs is not None
        per_slot = slot_cost(driver.chat_prompts, driver.long_prompts, config.long_share, costs.answer())
        cost = per_slot.quantile(knee.level) if per_slot is not None else 0.0
        rec = recommend(
            at_knee,
            config.ttft_slo,
            config.batch_queue_wait,
            inflight_budget=budget_tokens(cost) if cost > 0 else None,
        )
    return Outcome(
        "",
        "",
        config,
        steps,
        runs,
        stopped,
        first_errors,
        knee,
        why,
        rec,
        plan=plan,
        probe=probe,
        slot_cost=per_slot,
    )
