"""Calibrate's run: its settings, the probe, the plan and the measurement loop over the levels.

:func:`run_ramp` probes one request (:class:`~llm_backoff_shim.lab.calibrate_driver.Driver`),
prints the plan (:mod:`~llm_backoff_shim.lab.calibrate_plan`), measures the levels
:func:`~llm_backoff_shim.lab.knee.next_level` asks for on one closed loop
(:mod:`~llm_backoff_shim.lab.calibrate_loop`) within the run's time cap, and returns an
:class:`Outcome` for :mod:`llm_backoff_shim.lab.calibrate_report`. The command and its
flags are :mod:`llm_backoff_shim.lab.calibrate`.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import openai

from .calibrate_cost import budget_tokens
from .calibrate_driver import Driver, error_text, streaming_http_client
from .calibrate_engine import INTERVAL, EngineGauges, metrics_fetch
from .calibrate_history import RunRecord
from .calibrate_loop import ClosedLoop, measure_level
from .calibrate_plan import (
    Sizing,
    SweepPlan,
    coarse,
    duration_text,
    expected_duration,
    measurement_seconds,
    plan_lines,
    plan_sweep,
    time_to_go,
)
from .calibrate_samples import Sample, summarize
from .knee import (
    BATCH_QUEUE_WAIT,
    Confidence,
    Knee,
    KneeRule,
    Recommendation,
    StepStats,
    find_knee,
    next_level,
    recommend,
    with_confidence,
)
from .workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, LengthDist

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
    #: (:mod:`~llm_backoff_shim.lab.calibrate_history`); None until then.
    own_confidence: tuple[Confidence, str] | None = None
    #: The previous run of the same setup in ``--out`` (None: the first).
    previous_run: RunRecord | None = None


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
    if knee.level is not None:
        at_knee = runs[knee.level]
        # The budget holds the knee's requests as they ran together, not their mean: at the mean
        # a level's own prompts pass it half the time, and slots stay idle with callers waiting.
        cost = statistics.median(s.inflight_cost_high for s in at_knee)
        rec = recommend(
            at_knee,
            config.ttft_slo,
            config.batch_queue_wait,
            inflight_budget=budget_tokens(cost) if cost > 0 else None,
        )
    return Outcome("", "", config, steps, runs, stopped, first_errors, knee, why, rec, plan=plan, probe=probe)
