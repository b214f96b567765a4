"""Calibrate's ramp: its settings, the closed-loop load generator (I/O) and the measurement loop.

:class:`Driver` sends streaming chat completions of the mix through one ``AsyncOpenAI``
client (the probe, and the requests of the closed loop of
:mod:`~llm_backoff_shim.lab.calibrate_loop`); :func:`run_ramp` probes, prints the plan
(:mod:`~llm_backoff_shim.lab.calibrate_plan`), measures the levels
:func:`~llm_backoff_shim.lab.knee.next_level` asks for within the run's time cap, and
returns an :class:`Outcome` for
:mod:`llm_backoff_shim.lab.calibrate_report`. The command and its flags are
:mod:`llm_backoff_shim.lab.calibrate`.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai

from .calibrate_cost import budget_tokens, request_cost
from .calibrate_loop import ClosedLoop, Live, measure_level
from .calibrate_plan import (
    Sizing,
    SweepPlan,
    coarse,
    duration_text,
    measurement_seconds,
    plan_lines,
    plan_sweep,
    settle_measurements,
)
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

#: Long prompts' length when ``--long-share`` is set without ``--long-prompt-tokens``: the
#: retrieval-augmented and agent calls of a mixed load, 1500-3000 tokens.
DEFAULT_LONG_PROMPT_WORDS = LengthDist.uniform(1500, 3000)

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
    """Sends calibrate's requests through one ``AsyncOpenAI`` client, lengths drawn from the mix."""

    client: openai.AsyncOpenAI
    model: str
    config: CalibrateConfig
    clock: Callable[[], float]
    rng: random.Random = field(default_factory=random.Random)

    def draw(self) -> tuple[int, int]:
        """One request's prompt words and ``max_tokens``, from the mix."""
        cfg = self.config
        long = cfg.long_share > 0 and self.rng.random() < cfg.long_share
        words = (cfg.long_prompt_words if long else cfg.prompt_words).draw(self.rng)
        return words, cfg.output_tokens.draw(self.rng)

    async def probe(self) -> Sample:
        """One request of the mix's mean lengths, alone: how long a request takes."""
        words = max(1, round(self.config.mean_prompt_words()))
        max_tokens = max(1, round(self.config.output_tokens.mean()))
        return await self.one_request(0, -1, {}, lengths=(words, max_tokens))

    async def one_request(
        self,
        worker: int,
        seq: int,
        live: dict[tuple[int, int], Live],
        lengths: tuple[int, int] | None = None,
    ) -> Sample:
        """One streamed request, registered in ``live`` while it runs (its chunks' times too)."""
        cfg = self.config
        words, max_tokens = lengths or self.draw()
        prompt = prompt_text(words, self.rng)
        extra: dict[str, object] = {"ignore_eos": True} if cfg.ignore_eos else {}
        start = self.clock()
        # Until the upstream counts the prompt (usage), its words stand for its tokens.
        running = Live(worker, seq, start, request_cost(words, max_tokens))
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
                worker, seq, start, self.clock(), ok=False, error=_error_text(exc), cost=running.cost
            )
        finally:
            live.pop((worker, seq), None)
        end = self.clock()
        tokens = int(getattr(usage, "completion_tokens", 0) or len(times))
        prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
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
            cost=request_cost(prompt_tokens or words, max_tokens),
            token_times=tuple(times),
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


def _progress_line(index: int, step: StepStats, seconds: float, first_error: str | None) -> str:
    line = (
        f"[{index}] concurrency {step.concurrency:>4}: {step.requests} ok, {step.errors} failed "
        f"in a {step.window:.1f} s window ({seconds:.1f} s with ramp-in) | {step.throughput:.2f} req/s, "
        f"{step.output_tokens_per_s:.0f} tok/s | TTFT p50 {step.ttft_p50:.3f} p99 {step.ttft_p99:.3f} s | "
        f"TPOT p99 {step.itl_p99 * 1000:.1f} ms | {step.mean_latency:.1f} s per request"
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


def expected_duration(
    level: int, probe: float, runs: dict[int, list[StepStats]], *, full: bool = True
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
    runs: dict[int, list[StepStats]],
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
    """Probe, plan, then measure levels as :func:`~llm_backoff_shim.lab.knee.next_level` asks,
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
        outcome = await _sweep(driver, config, plan, probe, run_deadline, progress)
    outcome.upstream, outcome.model, outcome.seconds = shim_upstream, model, clock() - began
    return outcome


async def _sweep(
    driver: Driver,
    config: CalibrateConfig,
    plan: SweepPlan,
    probe: Sample,
    run_deadline: float,
    progress: Callable[[str], None],
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
            progress(
                _progress_line(index, step, clock() - began, error)
                + f" | about {to_go} to go (at this pace; if the engine is already full)"
            )
            if all(s.requests == 0 for s in steps):
                stopped = f"every request failed at concurrency {level}"
                break
        else:
            stopped = "measurement budget used up"
    finally:
        await loop.close()
    knee, why = with_confidence(find_knee(runs, rule), history, rule)
    rec = None
    if knee.level is not None:
        at_knee = runs[knee.level]
        cost = statistics.median(s.inflight_cost for s in at_knee)
        rec = recommend(
            at_knee,
            config.ttft_slo,
            config.batch_queue_wait,
            inflight_budget=budget_tokens(cost) if cost > 0 else None,
        )
    return Outcome("", "", config, steps, runs, stopped, first_errors, knee, why, rec, plan=plan, probe=probe)
