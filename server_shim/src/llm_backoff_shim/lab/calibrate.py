"""``llm-backoff-shim calibrate``: load-test an upstream, find the knee, suggest shim settings.

    llm-backoff-shim calibrate --upstream http://127.0.0.1:8000 --ttft-slo 1.0 --tpot-slo 0.1

Ramps a closed loop of N workers (N = 1, 2, 4, ... up to ``--max-level``, or a
``--steps`` list); each worker sends a streaming chat completion
(``stream_options.include_usage``, vLLM's ``ignore_eos``) whose prompt and answer lengths
are drawn (seeded) from ``--prompt-words`` and ``--output-tokens`` (lognormal by default,
as chat traffic is), and sends the next one when it ends. A step stops starting requests
after ``--step-seconds`` or ``--step-requests``, lets those in flight finish, and reports
TTFT, time per output token (TPOT) and throughput in answer tokens/s.

Which level to measure next, when to stop and where the knee is are
:mod:`llm_backoff_shim.lab.knee` (pure): the ramp climbs while the SLOs hold and throughput
rises, then repeats the levels next to the knee until the verdict is stable, and the
recommendation says how confident it is. The whole run never exceeds ``--max-seconds``
(requests still running then are cancelled). This module is the load generator, the
statistics of one step and the command; :mod:`llm_backoff_shim.lab.calibrate_report` the
table, JSON and PNG.

Exit status: 0 with a recommendation, 1 without one (SLO unmet at every level, or the
upstream unusable), 2 on bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import openai

from .calibrate_report import plot, render_text, to_json
from .extra import MissingLabExtraError
from .knee import (
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
PNG_NAME = "calibrate.png"  # written into --out
DEFAULT_TTFT_SLO = 2.0
DEFAULT_TPOT_SLO = 0.1


class CalibrateError(Exception):
    """The run cannot go on (upstream unreachable, no model...); ``str()`` is one line for users."""


# -- flags ------------------------------------------------------------------------------


def doubling_levels(max_level: int) -> list[int]:
    """1, 2, 4, ... up to ``max_level``, which is always the last level."""
    levels = []
    level = 1
    while level < max_level:
        levels.append(level)
        level *= 2
    levels.append(max_level)
    return levels


def parse_steps(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated positive integers, got {text!r}") from None
    if not levels or any(level < 1 for level in levels):
        raise ValueError(f"expected comma-separated positive integers, got {text!r}")
    if any(b <= a for a, b in itertools.pairwise(levels)):
        raise ValueError(f"levels must be strictly increasing, got {text!r}")
    return levels


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
    upstream: str
    ttft_slo: float
    levels: tuple[int, ...]
    model: str | None = None
    api_key: str = "EMPTY"
    tpot_slo: float | None = DEFAULT_TPOT_SLO
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Load-test an OpenAI-compatible upstream (vLLM, the simulator) with a closed-loop "
        "concurrency ramp of varied prompt and answer lengths, find the knee (the lowest level whose "
        "p99 TTFT and p99 time per output token meet --ttft-slo and --tpot-slo with as much throughput "
        "as any level within them, repeated until the verdict is stable) and print the "
        "`llm-backoff-shim serve` flags it implies with how confident it is, a table of the levels "
        "and a PNG of the curves. Bounded in time and requests. "
        "Exit status: 0 with a recommendation, 1 without one, 2 on bad flags.",
    )
    add = p.add_argument
    add("--upstream", required=True, metavar="URL", help="base URL of the engine, e.g. http://127.0.0.1:8000")
    add(
        "--ttft-slo",
        type=float,
        default=DEFAULT_TTFT_SLO,
        metavar="SECONDS",
        help="p99 time-to-first-token SLO; the default, %(default)s s, is a common interactive "
        "target: set yours",
    )
    add(
        "--tpot-slo",
        default=str(DEFAULT_TPOT_SLO),
        metavar="SECONDS|none",
        help="p99 time-per-output-token SLO (a request's mean gap between tokens after the first); "
        "the default, %(default)s s (10 tokens/s, faster than people read), is a common target: "
        "set yours, or 'none' to judge TTFT only",
    )
    add("--model", help="model to ask for (default: the first of /v1/models)")
    add(
        "--api-key",
        metavar="KEY",
        help="bearer token (default: $OPENAI_API_KEY, else 'EMPTY' as vLLM accepts)",
    )
    add(
        "--max-level",
        type=int,
        default=256,
        metavar="N",
        help="top of the 1, 2, 4, ... ramp (default %(default)s)",
    )
    add(
        "--steps",
        metavar="N,N,...",
        help="explicit concurrency levels, e.g. 1,2,4,6,8 (overrides --max-level)",
    )
    add(
        "--prompt-words",
        "--prompt-tokens",
        dest="prompt_words",
        default=str(DEFAULT_PROMPT_WORDS),
        metavar="SPEC",
        help="prompt length in words of common English (about a token each with large BPE "
        "vocabularies, more with small ones: the table shows the upstream's own count): N, "
        "LOW-HIGH (uniform) or lognormal:MEDIAN:SIGMA[:LOW-HIGH], drawn per request (seeded) "
        "(default %(default)s)",
    )
    add(
        "--output-tokens",
        default=str(DEFAULT_OUTPUT_TOKENS),
        metavar="SPEC",
        help="answer length (max_tokens), same forms as --prompt-words (default %(default)s)",
    )
    add(
        "--step-seconds",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="how long each level keeps starting requests (default %(default)s)",
    )
    add(
        "--step-requests",
        type=int,
        default=1000,
        metavar="N",
        help="most requests per level (default %(default)s)",
    )
    add(
        "--max-seconds",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="cap on the whole run; requests still running then are cancelled (default %(default)s)",
    )
    add(
        "--request-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="one request fails after this long (default %(default)s)",
    )
    add(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send vLLM's ignore_eos (for upstreams that refuse unknown fields; answers may "
        "then end before --output-tokens)",
    )
    add("--seed", type=int, default=0, help="seed of the length draws and prompt words (default %(default)s)")
    add(
        "--repeats",
        type=int,
        default=4,
        metavar="N",
        help="most measurements of each level next to the knee while the verdict moves; at least "
        "two each unless N is 1 (default %(default)s)",
    )
    add(
        "--tolerance",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="throughput within this fraction of the best is as good: the knee is the lowest such "
        "level, and a level must add more than this to count as a rise (default %(default)s)",
    )
    add(
        "--max-error-rate",
        type=float,
        default=0.01,
        metavar="FRACTION",
        help="a level with a larger share of failed requests is past the knee (default %(default)s)",
    )
    add("--out", default=".", metavar="DIR", help=f"directory for {PNG_NAME} (default: the current one)")
    add("--json", action="store_true", help="print the result as JSON on stdout (progress stays on stderr)")
    return p


def config_from_args(args: argparse.Namespace) -> CalibrateConfig:
    """Validated settings; raises ``ValueError`` naming the flag at fault."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    def finite_positive(value: float) -> bool:
        return math.isfinite(value) and value > 0

    try:
        _, _ = api_base(args.upstream)
    except ValueError as exc:
        raise ValueError(f"--upstream: {exc}") from None
    check(
        finite_positive(args.ttft_slo),
        f"--ttft-slo: must be a positive number of seconds, got {args.ttft_slo}",
    )
    if args.steps is not None:
        try:
            levels = parse_steps(args.steps)
        except ValueError as exc:
            raise ValueError(f"--steps: {exc}") from None
    else:
        check(1 <= args.max_level <= 100_000, f"--max-level: must be 1..100000, got {args.max_level}")
        levels = doubling_levels(args.max_level)
    check(levels[-1] <= 100_000, "--steps: levels above 100000 are not supported")
    tpot_slo: float | None = None
    if args.tpot_slo.strip().lower() not in ("none", "off", ""):
        try:
            tpot_slo = float(args.tpot_slo)
        except ValueError:
            raise ValueError(f"--tpot-slo: expected seconds or 'none', got {args.tpot_slo!r}") from None
        check(finite_positive(tpot_slo), f"--tpot-slo: must be a positive number of seconds, got {tpot_slo}")
    lengths = {}
    for flag, text in (("--prompt-words", args.prompt_words), ("--output-tokens", args.output_tokens)):
        try:
            lengths[flag] = LengthDist.parse(text)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    check(finite_positive(args.step_seconds), f"--step-seconds: must be > 0, got {args.step_seconds}")
    check(args.step_requests >= 1, f"--step-requests: must be >= 1, got {args.step_requests}")
    check(finite_positive(args.max_seconds), f"--max-seconds: must be > 0, got {args.max_seconds}")
    check(
        args.max_seconds >= args.step_seconds,
        f"--max-seconds ({args.max_seconds:g}) must be at least --step-seconds ({args.step_seconds:g})",
    )
    check(
        finite_positive(args.request_timeout), f"--request-timeout: must be > 0, got {args.request_timeout}"
    )
    check(1 <= args.repeats <= 20, f"--repeats: must be 1..20, got {args.repeats}")
    check(0 <= args.tolerance < 0.5, f"--tolerance: must be in [0, 0.5), got {args.tolerance}")
    check(0 <= args.max_error_rate < 1, f"--max-error-rate: must be in [0, 1), got {args.max_error_rate}")
    check(args.model is None or bool(args.model.strip()), "--model: must not be empty")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return CalibrateConfig(
        upstream=args.upstream,
        ttft_slo=args.ttft_slo,
        levels=tuple(levels),
        model=args.model,
        api_key=api_key,
        tpot_slo=tpot_slo,
        prompt_words=lengths["--prompt-words"],
        output_tokens=lengths["--output-tokens"],
        step_seconds=args.step_seconds,
        step_requests=args.step_requests,
        max_seconds=args.max_seconds,
        request_timeout=args.request_timeout,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        max_error_ratio=args.max_error_rate,
        repeats=args.repeats,
        tolerance=args.tolerance,
        out=Path(args.out),
        json=args.json,
    )


# -- one step's statistics (pure) -------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it. Times are clock readings, seconds.

    ``first_token`` is None for a failed request or an answer without content;
    ``itl`` is the request's mean gap between tokens after the first (None below two).
    """

    worker: int
    seq: int
    start: float
    end: float
    ok: bool
    first_token: float | None = None
    itl: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method: between the two nearest ranks of
    ``(n - 1) * q / 100``); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(float(v) for v in values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def steady_samples(samples: Sequence[Sample]) -> list[Sample]:
    """Successful samples without each worker's first request (warm-up), unless that leaves none.

    The first wave starts all at once, before the engine's batch has settled; later
    requests start whenever one ends, which is the steady state being measured.
    """
    ok = [s for s in samples if s.ok]
    steady = [s for s in ok if s.seq > 0]
    return steady or ok


def summarize(concurrency: int, samples: Sequence[Sample]) -> StepStats:
    """The statistics of one level.

    Throughput is ``concurrency / mean latency``: Little's law for a closed loop with no
    think time, where every worker always has one request outstanding. Unlike counting
    completions in a window it needs no window and stays accurate when a step holds only
    a few long requests. Failed requests are left out of it, which overstates a level
    with many fast failures; such a level is past the knee by its error share anyway.
    """
    used = steady_samples(samples)
    errors = sum(1 for s in samples if not s.ok)
    if not used:
        return StepStats(concurrency, 0, errors, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    latencies = [s.end - s.start for s in used]
    ttfts = [(s.first_token if s.first_token is not None else s.end) - s.start for s in used]
    itls = [s.itl for s in used if s.itl is not None]
    mean_latency = statistics.fmean(latencies)
    throughput = concurrency / mean_latency if mean_latency > 0 else 0.0
    mean_output = statistics.fmean([s.output_tokens for s in used])
    return StepStats(
        concurrency=concurrency,
        requests=len(used),
        errors=errors,
        throughput=throughput,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        latency_p50=percentile(latencies, 50),
        latency_p99=percentile(latencies, 99),
        output_tokens_per_s=throughput * mean_output,
        mean_prompt_tokens=statistics.fmean([s.prompt_tokens for s in used]),
        mean_output_tokens=mean_output,
        ttft_p90=percentile(ttfts, 90),
        latency_p90=percentile(latencies, 90),
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


def _http_client(pool: int) -> Any:
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
        http_client=_http_client(max(config.levels)),
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
        # Bounded whatever the plan says: every level climbed once, the ones next to the knee
        # repeated, a few refinements.
        for index in range(1, len(config.levels) + 4 * config.repeats + 2 * rule.refine + 1):
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
    rec = recommend(runs[knee.level], config.ttft_slo) if knee.level is not None else None
    return Outcome(shim_upstream, model, config, steps, runs, stopped, first_errors, knee, why, rec)


def main(argv: list[str], *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Entry point of ``llm-backoff-shim calibrate``; returns the exit status."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"{PROG}: invalid configuration: {exc}", file=err)
        return 2

    def progress(line: str) -> None:
        print(line, file=err, flush=True)

    try:
        outcome = asyncio.run(run_ramp(config, clock=time.monotonic, progress=progress))
    except CalibrateError as exc:
        print(f"{PROG}: {exc}", file=err)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=err)
        return 130
    if outcome.steps:
        try:
            outcome.png = plot(outcome, config.out / PNG_NAME)
        except MissingLabExtraError as exc:  # the measurement stands without its picture
            print(f"{PROG}: {PNG_NAME} not written: {exc}", file=err)
        except OSError as exc:
            print(f"{PROG}: cannot write {config.out / PNG_NAME}: {exc}", file=err)
    if config.json:
        print(json.dumps(to_json(outcome), indent=2), file=out)
    else:
        print(render_text(outcome), file=out)
    return 0 if outcome.recommendation is not None else 1
