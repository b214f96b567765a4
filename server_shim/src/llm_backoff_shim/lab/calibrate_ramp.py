"""Calibrate's ramp: its settings, the closed-loop load generator (I/O) and the measurement loop.

:class:`Driver` sends streaming chat completions through one ``AsyncOpenAI`` client,
``concurrency`` workers at a time, each sending its next request when the last ends;
:func:`run_ramp` measures the levels :func:`~llm_backoff_shim.lab.knee.next_level` asks
for, within the run's time cap, and returns an :class:`Outcome` for
:mod:`llm_backoff_shim.lab.calibrate_report`. The command and its flags are
:mod:`llm_backoff_shim.lab.calibrate`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai

from .calibrate_samples import Sample, summarize
from .knee import (
    BATCH_QUEUE_WAIT,
    Knee,
    KneeRule,
    Recommendation,
    StepStats,
    find_knee,
    next_level,
    recommend,
    with_confidence,
)
from .workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, LengthDist, prompt_text

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
    step_seconds: float = 20.0
    step_requests: int = 1000
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

    def longest_run(self) -> float:
        """Seconds the run can take at most: ``max_seconds``, or less when even the longest
        plan (listing the models, then every measurement's ``step_seconds`` plus its last
        requests, each bounded by ``request_timeout``) ends sooner."""
        plan = self.request_timeout + self.max_measurements * (self.step_seconds + self.request_timeout)
        return min(self.max_seconds, plan)

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
        )


# -- the load generator (I/O) -------------------------------------------------------------


def _has_content(delta: Any) -> bool:
    if delta is None:
        return False
    # vLLM streams reasoning models' thinking in reasoning_content (older) or reasoning.
    return any(
        getattr(delta, name, None) for name in ("content", "reasoning_content", "reasoning", "tool_calls")
    )


def _error_text(exc: BaseException) -> str:
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
    """Sends the ramp's requests through one ``AsyncOpenAI`` client."""

    client: openai.AsyncOpenAI
    model: str
    config: CalibrateConfig
    clock: Callable[[], float]
    rng: random.Random = field(default_factory=random.Random)

    async def one_request(self, worker: int, seq: int) -> Sample:
        cfg = self.config
        prompt = prompt_text(cfg.prompt_words.draw(self.rng), self.rng)
        max_tokens = cfg.output_tokens.draw(self.rng)
        extra: dict[str, object] = {"ignore_eos": True} if cfg.ignore_eos else {}
        start = self.clock()
        first: float | None = None
        last: float | None = None
        chunks = 0
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
                        if first is None:
                            first = now
                        last = now
                        chunks += 1
        except Exception as exc:  # a load generator records any failure and carries on
            return Sample(worker, seq, start, self.clock(), ok=False, error=_error_text(exc))
        end = self.clock()
        tokens = int(getattr(usage, "completion_tokens", 0) or chunks)
        itl = None
        if first is not None and last is not None and tokens >= 2 and last > first:
            itl = (last - first) / (tokens - 1)
        return Sample(
            worker,
            seq,
            start,
            end,
            ok=True,
            first_token=first,
            itl=itl,
            output_tokens=tokens,
            prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
        )

    async def run_step(self, concurrency: int, seconds: float, max_requests: int) -> list[Sample]:
        """Closed loop of ``concurrency`` workers; returns once every started request ended."""
        samples: list[Sample] = []
        stop_at = self.clock() + seconds
        started = 0

        async def worker(index: int) -> None:
            nonlocal started
            seq = 0
            while started < max_requests and self.clock() < stop_at:
                started += 1
                samples.append(await self.one_request(index, seq))
                seq += 1

        tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            # Cancelled streams close their connections, so the upstream aborts them too.
            await asyncio.gather(*tasks, return_exceptions=True)
        return samples


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


def _progress_line(index: int, step: StepStats, seconds: float, first_error: str | None) -> str:
    line = (
        f"[{index}] concurrency {step.concurrency:>4}: {step.requests} ok, {step.errors} failed "
        f"in {seconds:.1f} s | {step.throughput:.2f} req/s, {step.output_tokens_per_s:.0f} tok/s | "
        f"TTFT p50 {step.ttft_p50:.3f} p99 {step.ttft_p99:.3f} s | TPOT p99 {step.itl_p99 * 1000:.1f} ms"
    )
    return line + (f" | first error: {first_error}" if first_error else "")


async def _pick_model(client: openai.AsyncOpenAI, upstream: str) -> str:
    try:
        page = await client.models.list()
    except Exception as exc:  # any failure here means the upstream is unusable as given
        raise CalibrateError(
            f"cannot list models at {upstream}: {_error_text(exc)} (or pass --model)"
        ) from None
    ids = [m.id for m in page.data]
    if not ids:
        raise CalibrateError(f"{upstream}/v1/models lists no model; pass --model")
    return ids[0]


async def run_ramp(
    config: CalibrateConfig,
    *,
    clock: Callable[[], float],
    progress: Callable[[str], None],
) -> Outcome:
    """Measure levels as :func:`~llm_backoff_shim.lab.knee.next_level` asks, within ``config.max_seconds``."""
    base_url, shim_upstream = api_base(config.upstream)
    rule = config.rule
    client = openai.AsyncOpenAI(
        base_url=base_url,
        api_key=config.api_key,
        max_retries=0,  # measure the upstream, not the SDK's retries
        timeout=config.request_timeout,
        http_client=streaming_http_client(max(config.levels)),
    )
    run_deadline = clock() + config.max_seconds
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
        steps: list[StepStats] = []
        runs: dict[int, list[StepStats]] = {}
        history: list[int | None] = []
        first_errors: dict[int, str] = {}
        stopped = "all levels measured"
        tpot = "off" if config.tpot_slo is None else f"{config.tpot_slo:g} s"
        progress(
            f"{PROG}: {shim_upstream} model {model!r}, levels {','.join(map(str, config.levels))}, "
            f"SLO p99 TTFT {config.ttft_slo:g} s / TPOT {tpot}, up to {config.step_seconds:g} s / "
            f"{config.step_requests} requests per measurement, at most {config.max_seconds:g} s in all"
        )
        # Bounded whatever the plan says (CalibrateConfig.max_measurements).
        for index in range(1, config.max_measurements + 1):
            plan = next_level(runs, config.levels, rule, history)
            if plan.level is None:
                stopped = plan.purpose
                break
            level = plan.level
            remaining = run_deadline - clock()
            if remaining < config.step_seconds:
                stopped = (
                    f"--max-seconds {config.max_seconds:g} reached before concurrency {level} "
                    f"({plan.purpose})"
                )
                break
            progress(f"[{index}] concurrency {level:>4} ({plan.purpose}): running...")
            began = clock()
            try:
                samples = await asyncio.wait_for(
                    driver.run_step(level, config.step_seconds, config.step_requests), timeout=remaining
                )
            except asyncio.TimeoutError:
                stopped = f"--max-seconds {config.max_seconds:g} reached during concurrency {level}"
                progress(f"[{index}] concurrency {level:>4}: cut by --max-seconds; not counted")
                break
            step = summarize(level, samples)
            error = next((s.error for s in samples if s.error), None)
            if error:
                first_errors.setdefault(level, error)
            steps.append(step)
            runs.setdefault(level, []).append(step)
            history.append(find_knee(runs, rule).level)
            progress(_progress_line(index, step, clock() - began, error))
            if all(s.requests == 0 for s in steps):
                stopped = f"every request failed at concurrency {level}"
                break
        else:
            stopped = "measurement budget used up"
    knee, why = with_confidence(find_knee(runs, rule), history, rule)
    rec = None
    if knee.level is not None:
        rec = recommend(runs[knee.level], config.ttft_slo, config.batch_queue_wait)
    return Outcome(shim_upstream, model, config, steps, runs, stopped, first_errors, knee, why, rec)
