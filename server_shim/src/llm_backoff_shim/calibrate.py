"""``llm-backoff-shim calibrate``: load-test an upstream, find the knee, suggest shim settings.

    llm-backoff-shim calibrate --upstream http://127.0.0.1:8000 --ttft-slo 1.0

Ramps a closed loop of N workers (N = 1, 2, 4, ... up to ``--max-level``, or a
``--steps`` list); each worker sends a streaming chat completion
(``stream_options.include_usage``) with a seeded prompt/output length and sends the
next one when it ends. A step stops starting requests after ``--step-seconds`` or
``--step-requests``, lets those in flight finish, and reports TTFT, inter-token
latency and throughput. The ramp stops early once a step is past the knee, and the
whole run never exceeds ``--max-seconds`` (requests still running then are cancelled).
The knee and the recommendation are :mod:`llm_backoff_shim.knee` (pure); this module
is the load generator, the statistics of one step and the output (table, ``serve``
flags, PNG, ``--json``).

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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import numpy as np
import openai

from .knee import Knee, KneeRule, Recommendation, StepStats, find_knee, recommend, should_stop

PROG = "llm-backoff-shim calibrate"
PNG_NAME = "calibrate.png"
DEFAULT_TTFT_SLO = 2.0

#: Short common English words: about one token each with the usual BPE tokenizers, so
#: ``--prompt-tokens`` maps to a word count. Random order per request defeats prefix caching.
_WORDS_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give our "
    "under name very through just form great think say help low line differ turn cause much mean"
)
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())


class CalibrateError(Exception):
    """The run cannot go on (upstream unreachable, no model...); ``str()`` is one line for users."""


# -- flags ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthRange:
    """A token count drawn uniformly from ``low..high`` (inclusive); ``low == high`` is fixed."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """``"256"`` or ``"128-512"``; raises ``ValueError`` with a readable message."""
        parts = text.strip().split("-")
        try:
            if len(parts) == 1:
                low = high = int(parts[0])
            elif len(parts) == 2:
                low, high = int(parts[0]), int(parts[1])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"expected N or LOW-HIGH (positive integers), got {text!r}") from None
        if low < 1 or high < low:
            raise ValueError(f"expected 1 <= LOW <= HIGH, got {text!r}")
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


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
    prompt_tokens: LengthRange = LengthRange(512, 512)
    output_tokens: LengthRange = LengthRange(128, 128)
    step_seconds: float = 20.0
    step_requests: int = 1000
    max_seconds: float = 600.0
    request_timeout: float = 300.0
    ignore_eos: bool = True
    seed: int = 0
    max_elasticity: float = 1.0
    max_error_ratio: float = 0.01
    out: Path = Path(".")
    json: bool = False

    @property
    def rule(self) -> KneeRule:
        return KneeRule(self.ttft_slo, self.max_elasticity, self.max_error_ratio)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Load-test an OpenAI-compatible upstream (vLLM, the simulator) with a closed-loop "
        "concurrency ramp, find the knee (the highest level whose p99 TTFT meets --ttft-slo before "
        "p99 latency grows faster than throughput) and print the `llm-backoff-shim serve` flags it "
        "implies, a table of the steps and a PNG of the curves. Bounded in time and requests. "
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
        "--prompt-tokens",
        default="512",
        metavar="N|LOW-HIGH",
        help="prompt length, fixed or drawn uniformly (seeded) (default %(default)s)",
    )
    add(
        "--output-tokens",
        default="128",
        metavar="N|LOW-HIGH",
        help="answer length (max_tokens), fixed or drawn uniformly (seeded) (default %(default)s)",
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
        "--max-elasticity",
        type=float,
        default=1.0,
        metavar="E",
        help="a level is past the knee when ln(latency growth) / ln(throughput growth) exceeds E "
        "(default %(default)s)",
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
    lengths = {}
    for flag, text in (("--prompt-tokens", args.prompt_tokens), ("--output-tokens", args.output_tokens)):
        try:
            lengths[flag] = LengthRange.parse(text)
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
    check(
        finite_positive(args.max_elasticity),
        f"--max-elasticity: must be a positive number, got {args.max_elasticity}",
    )
    check(0 <= args.max_error_rate < 1, f"--max-error-rate: must be in [0, 1), got {args.max_error_rate}")
    check(args.model is None or bool(args.model.strip()), "--model: must not be empty")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return CalibrateConfig(
        upstream=args.upstream,
        ttft_slo=args.ttft_slo,
        levels=tuple(levels),
        model=args.model,
        api_key=api_key,
        prompt_tokens=lengths["--prompt-tokens"],
        output_tokens=lengths["--output-tokens"],
        step_seconds=args.step_seconds,
        step_requests=args.step_requests,
        max_seconds=args.max_seconds,
        request_timeout=args.request_timeout,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        max_elasticity=args.max_elasticity,
        max_error_ratio=args.max_error_rate,
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
    """Linear-interpolated percentile (numpy's default); 0.0 for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else 0.0


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
    mean_latency = float(np.mean(latencies))
    throughput = concurrency / mean_latency if mean_latency > 0 else 0.0
    mean_output = float(np.mean([s.output_tokens for s in used]))
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
        mean_prompt_tokens=float(np.mean([s.prompt_tokens for s in used])),
        mean_output_tokens=mean_output,
        ttft_p90=percentile(ttfts, 90),
        latency_p90=percentile(latencies, 90),
    )


# -- the load generator (I/O) -------------------------------------------------------------


def prompt_text(tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


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
        prompt = prompt_text(cfg.prompt_tokens.draw(self.rng), self.rng)
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
    upstream: str
    model: str
    config: CalibrateConfig
    steps: list[StepStats]
    stopped: str
    first_errors: dict[int, str]
    knee: Knee
    recommendation: Recommendation | None
    png: Path | None = None


def _progress_line(index: int, total: int, step: StepStats, seconds: float, first_error: str | None) -> str:
    line = (
        f"[{index}/{total}] concurrency {step.concurrency:>4}: {step.requests} ok, {step.errors} failed "
        f"in {seconds:.1f} s | {step.throughput:.2f} req/s, {step.output_tokens_per_s:.0f} tok/s | "
        f"TTFT p50 {step.ttft_p50:.3f} p99 {step.ttft_p99:.3f} s | ITL p50 {step.itl_p50 * 1000:.1f} ms"
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
    """Run the ramp within ``config.max_seconds`` and find the knee."""
    base_url, shim_upstream = api_base(config.upstream)
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
        first_errors: dict[int, str] = {}
        stopped = "all levels measured"
        total = len(config.levels)
        progress(
            f"{PROG}: {shim_upstream} model {model!r}, levels {','.join(map(str, config.levels))}, "
            f"up to {config.step_seconds:g} s / {config.step_requests} requests per level, "
            f"at most {config.max_seconds:g} s in all"
        )
        for index, level in enumerate(config.levels, 1):
            remaining = run_deadline - clock()
            if remaining < config.step_seconds:
                stopped = f"--max-seconds {config.max_seconds:g} reached before concurrency {level}"
                break
            progress(f"[{index}/{total}] concurrency {level:>4}: running...")
            began = clock()
            samples: list[Sample] = []
            try:
                samples = await asyncio.wait_for(
                    driver.run_step(level, config.step_seconds, config.step_requests), timeout=remaining
                )
            except asyncio.TimeoutError:
                stopped = f"--max-seconds {config.max_seconds:g} reached during concurrency {level}"
                progress(f"[{index}/{total}] concurrency {level:>4}: cut by --max-seconds; not counted")
                break
            step = summarize(level, samples)
            error = next((s.error for s in samples if s.error), None)
            if error:
                first_errors[level] = error
            steps.append(step)
            progress(_progress_line(index, total, step, clock() - began, error))
            if step.requests == 0:
                stopped = f"every request failed at concurrency {level}"
                break
            if should_stop(steps, config.rule) and index < total:
                stopped = f"past the knee at concurrency {level}; higher levels would only add load"
                break
    knee = find_knee(steps, config.rule)
    rec = recommend(knee.step, config.ttft_slo) if knee.step is not None else None
    return Outcome(shim_upstream, model, config, steps, stopped, first_errors, knee, rec)


# -- output -----------------------------------------------------------------------------


def serve_command(outcome: Outcome) -> str | None:
    if outcome.recommendation is None:
        return None
    flags = [
        "llm-backoff-shim",
        "serve",
        "--upstream",
        outcome.upstream,
        *outcome.recommendation.serve_flags(),
    ]
    return " ".join(flags)


def render_table(outcome: Outcome) -> str:
    header = (
        f"{'conc':>5} {'ok':>6} {'fail':>5} {'req/s':>8} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'lat p99':>8} {'elast':>6}  verdict"
    )
    lines = [header]
    knee_level = outcome.knee.step.concurrency if outcome.knee.step else None
    for step, verdict in zip(outcome.steps, outcome.knee.verdicts, strict=True):
        e = verdict.elasticity
        e_text = "-" if e is None else ("inf" if math.isinf(e) else f"{e:.2f}")
        notes = []
        if step.concurrency == knee_level:
            notes.append("KNEE")
        if not verdict.within_slo:
            notes.append("over SLO")
        if not verdict.errors_ok:
            notes.append("errors")
        if verdict.saturated:
            notes.append("saturated")
        lines.append(
            f"{step.concurrency:>5} {step.requests:>6} {step.errors:>5} {step.throughput:>8.2f} "
            f"{step.output_tokens_per_s:>8.0f} {step.ttft_p50:>8.3f}s {step.ttft_p99:>8.3f}s "
            f"{step.itl_p50 * 1000:>6.1f}ms {step.itl_p99 * 1000:>6.1f}ms {step.latency_p99:>7.2f}s "
            f"{e_text:>6}  {', '.join(notes) or 'ok'}"
        )
    return "\n".join(lines)


def _counted(steps: Sequence[StepStats]) -> str:
    """What the upstream's usage reported, to check the one-word-one-token prompt estimate."""
    measured = [s for s in steps if s.requests]
    if not measured or not any(s.mean_prompt_tokens for s in measured):
        return ""
    weight = sum(s.requests for s in measured)
    prompt = sum(s.mean_prompt_tokens * s.requests for s in measured) / weight
    output = sum(s.mean_output_tokens * s.requests for s in measured) / weight
    return f" ({prompt:.0f} / {output:.0f} on average by the upstream's count)"


def render_text(outcome: Outcome) -> str:
    cfg = outcome.config
    lines = [
        f"upstream {outcome.upstream}, model {outcome.model!r}, p99 TTFT SLO {cfg.ttft_slo:g} s, "
        f"prompt {cfg.prompt_tokens} / output {cfg.output_tokens} tokens asked{_counted(outcome.steps)}",
        "",
        render_table(outcome),
        "",
        f"ramp: {outcome.stopped}",
        f"knee: {outcome.knee.reason}",
    ]
    command = serve_command(outcome)
    rec = outcome.recommendation
    if command is not None and rec is not None and outcome.knee.step is not None:
        knee = outcome.knee.step
        lines += [
            "",
            f"recommended: at most {rec.max_concurrency} in flight (throughput {knee.throughput:.2f} req/s, "
            f"p99 TTFT {knee.ttft_p99:.3f} s there); a queue of {rec.max_queue} drains within "
            f"{rec.max_queue_wait:g} s, the SLO headroom left",
            "",
            f"  {command}",
        ]
    else:
        lines += ["", "no recommendation: " + outcome.knee.reason]
    if outcome.png is not None:
        lines += ["", f"curves: {outcome.png}"]
    return "\n".join(lines)


def to_json(outcome: Outcome) -> dict[str, Any]:
    cfg = outcome.config
    steps = []
    for step, verdict in zip(outcome.steps, outcome.knee.verdicts, strict=True):
        row: dict[str, Any] = asdict(step)
        e = verdict.elasticity
        row["elasticity"] = None if e is None or math.isinf(e) else e
        row["saturated"] = verdict.saturated
        row["within_slo"] = verdict.within_slo
        row["errors_ok"] = verdict.errors_ok
        row["first_error"] = outcome.first_errors.get(step.concurrency)
        steps.append(row)
    rec = outcome.recommendation
    return {
        "upstream": outcome.upstream,
        "model": outcome.model,
        "ttft_slo": cfg.ttft_slo,
        "prompt_tokens": str(cfg.prompt_tokens),
        "output_tokens": str(cfg.output_tokens),
        "levels": list(cfg.levels),
        "step_seconds": cfg.step_seconds,
        "step_requests": cfg.step_requests,
        "max_seconds": cfg.max_seconds,
        "seed": cfg.seed,
        "steps": steps,
        "stopped": outcome.stopped,
        "knee": None
        if outcome.knee.step is None
        else {"concurrency": outcome.knee.step.concurrency, "limit": outcome.knee.limit},
        "reason": outcome.knee.reason,
        "recommendation": None if rec is None else {**asdict(rec), "command": serve_command(outcome)},
        "png": None if outcome.png is None else str(outcome.png),
    }


def plot(outcome: Outcome, path: Path) -> Path:
    """Throughput, TTFT and ITL against concurrency, the SLO and the knee marked (PNG)."""
    # Figure without pyplot: no global figure registry, no GUI backend, safe off the main thread.
    from matplotlib.figure import Figure

    steps = outcome.steps
    xs = [s.concurrency for s in steps]
    fig = Figure(figsize=(8, 9), dpi=100, layout="constrained")
    ax_x, ax_ttft, ax_itl = fig.subplots(3, 1, sharex=True)
    ax_x.plot(xs, [s.throughput for s in steps], "o-", color="tab:blue")
    ax_x.set_ylabel("throughput (req/s)")
    ax_ttft.plot(xs, [s.ttft_p50 for s in steps], "o-", color="tab:green", label="TTFT p50")
    ax_ttft.plot(xs, [s.ttft_p99 for s in steps], "s-", color="tab:red", label="TTFT p99")
    ax_ttft.axhline(outcome.config.ttft_slo, color="tab:red", linestyle=":", label="SLO (p99)")
    ax_ttft.set_ylabel("TTFT (s)")
    ax_ttft.legend(loc="upper left")
    ax_itl.plot(xs, [s.itl_p50 * 1000 for s in steps], "o-", color="tab:purple", label="ITL p50")
    ax_itl.plot(xs, [s.itl_p99 * 1000 for s in steps], "s-", color="tab:orange", label="ITL p99")
    ax_itl.set_ylabel("inter-token latency (ms)")
    ax_itl.set_xlabel("concurrency (closed-loop workers)")
    ax_itl.legend(loc="upper left")
    if len(xs) > 1:
        ax_itl.set_xscale("log", base=2)
    ax_itl.set_xticks(xs, [str(x) for x in xs])
    if outcome.knee.step is not None:
        knee = outcome.knee.step.concurrency
        for ax in (ax_x, ax_ttft, ax_itl):
            ax.axvline(knee, color="black", linestyle="--", linewidth=1)
        ax_x.annotate(
            f"knee: {knee}",
            xy=(knee, outcome.knee.step.throughput),
            xytext=(6, -14),
            textcoords="offset points",
        )
    for ax in (ax_x, ax_ttft, ax_itl):
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"{outcome.model} @ {outcome.upstream}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


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
        except OSError as exc:
            print(f"{PROG}: cannot write {config.out / PNG_NAME}: {exc}", file=err)
    if config.json:
        print(json.dumps(to_json(outcome), indent=2), file=out)
    else:
        print(render_text(outcome), file=out)
    return 0 if outcome.recommendation is not None else 1
