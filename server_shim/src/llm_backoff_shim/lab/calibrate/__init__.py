"""``llm-backoff-shim calibrate``: load-test an upstream, find the knee, suggest shim settings.

    llm-backoff-shim calibrate --upstream http://127.0.0.1:8000 --ttft-slo 1.0 --tpot-slo 0.1

First a probe: one request of the mix's mean lengths, alone, measures how long a request
takes; from it calibrate sizes each level's measurement in request durations
(:mod:`llm_backoff_shim.lab.calibrate.run`), prints how long the sweep will take and what
it cuts to fit ``--max-seconds``. Then a closed loop of N workers (N = 1, 2, 4, ... up to
``--max-level``, or a ``--steps`` list) runs the whole sweep; each worker sends a streaming
chat completion (``stream_options.include_usage``, vLLM's ``ignore_eos``) whose prompt and
answer lengths are drawn (seeded) from the mix (``--prompt-words``, ``--output-tokens``,
``--long-share`` of ``--long-prompt-words``), and sends the next one when it ends. Each
level waits out its ramp-in, counts its completions in a steady window and reports TTFT,
time per output token (TPOT), throughput and the cost in flight.

Which level to measure next, when to stop and where the knee is are the knee rule (pure):
the ramp climbs while the SLOs hold and throughput rises, then repeats the levels next to the
knee until the verdict is stable, and the recommendation says how confident it is. The whole
run never exceeds ``--max-seconds`` (requests still running then are cancelled).

Calibrate is one package, one concept a module:

- this module: the command and its flags;
- :mod:`~llm_backoff_shim.lab.calibrate.run`: one run (I/O): the probe, the plan, the closed
  loop and its requests, the engine's gauges;
- :mod:`~llm_backoff_shim.lab.calibrate.measure`: what is measured and concluded (pure): a
  level's samples, a request's cost, the knee rule and the recommendation;
- :mod:`~llm_backoff_shim.lab.calibrate.report`: what it prints and draws: the table, the serve
  command, JSON and PNG (the PNG needs the ``lab`` extra, matplotlib: without it the rest is
  printed and the PNG skipped, with a line saying which extra to install);
- :mod:`~llm_backoff_shim.lab.calibrate.history`: the runs kept in ``--out``, and the
  confidence earned across them.

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
import statistics
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from ..extra import MissingLabExtraError
from ..workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, LengthDist
from ..workloads import WORKLOADS, NamedWorkload, named_workload
from .history import HISTORY_NAME, RunRecord, across_runs, append, load, previous
from .measure import BATCH_QUEUE_WAIT
from .report import plot, recommended_config, render_text, to_json
from .run import (
    DEFAULT_LONG_PROMPT_WORDS,
    DEFAULT_TPOT_SLO,
    DEFAULT_TTFT_SLO,
    PROG,
    CalibrateConfig,
    CalibrateError,
    Outcome,
    api_base,
    duration_text,
    run_ramp,
)

PNG_NAME = "calibrate.png"  # written into --out


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


def finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def seconds_or_none(flag: str, text: str) -> float | None:
    """A flag's positive number of seconds, or None for 'none' / 'off' / empty."""
    if text.strip().lower() in ("none", "off", ""):
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{flag}: expected seconds or 'none', got {text!r}") from None
    if not finite_positive(seconds):
        raise ValueError(f"{flag}: must be a positive number of seconds, got {seconds:g}")
    return seconds


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
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
    add(
        "--batch-queue-wait",
        default=str(BATCH_QUEUE_WAIT),
        metavar="SECONDS|none",
        help="the longest a batch request waits in the shim for a slot, recommended with a queue the "
        "engine drains in that time (default %(default)s s; a caller's own x-request-timeout-ms "
        "budget, when shorter, bounds its wait); 'none': batch shares the interactive queue's bounds",
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
        "--long-share",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="share of requests with a long prompt (retrieval, agents), drawn from "
        "--long-prompt-words (default %(default)s: none)",
    )
    add(
        "--long-prompt-words",
        dest="long_prompt_words",
        default=str(DEFAULT_LONG_PROMPT_WORDS),
        metavar="SPEC",
        help="the long prompts' length in words, same forms as --prompt-words (default %(default)s)",
    )
    add(
        "--workload",
        metavar="NAME",
        help=f"size the lengths above from a named workload ({', '.join(WORKLOADS)}; prompt tokens as "
        "words one for one): its interactive prompts and answers, its batch share as long prompts; "
        "a length flag set to other than its default wins",
    )
    # Retired: they counted words, not tokens (a word is 1.3 tokens on one model, 2.5 on another).
    for retired in ("--prompt-tokens", "--long-prompt-tokens"):
        add(retired, dest=retired[2:].replace("-", "_"), default=None, help=argparse.SUPPRESS)
    add(
        "--completions-per-slot",
        type=int,
        default=2,
        metavar="N",
        help="each level's steady window counts N completions per worker (default %(default)s)",
    )
    add(
        "--min-completions",
        type=int,
        default=20,
        metavar="N",
        help="... and at least N in all, unless that is over 6 request durations (default %(default)s)",
    )
    add(
        "--step-seconds",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="shortest steady window of a level, for fast engines (default %(default)s)",
    )
    add(
        "--step-requests",
        type=int,
        default=1000,
        metavar="N",
        help="most completions a level's window counts (default %(default)s)",
    )
    add(
        "--max-seconds",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="cap on the whole run: the plan printed after the probe cuts steps, repeats and levels "
        "to fit, and requests still running at the end are cancelled (default %(default)s: 10 minutes)",
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
    add(
        "--write-config",
        metavar="PATH",
        help="write the recommendation as a settings file for 'llm-backoff-shim serve --config PATH'",
    )
    add("--json", action="store_true", help="print the result as JSON on stdout (progress stays on stderr)")
    return p


def config_from_args(args: argparse.Namespace) -> CalibrateConfig:
    """Validated settings; raises ``ValueError`` naming the flag at fault."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

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
    tpot_slo = seconds_or_none("--tpot-slo", args.tpot_slo)
    batch_queue_wait = seconds_or_none("--batch-queue-wait", args.batch_queue_wait)
    for retired, words in (
        ("prompt_tokens", "--prompt-words"),
        ("long_prompt_tokens", "--long-prompt-words"),
    ):
        check(
            getattr(args, retired) is None,
            f"--{retired.replace('_', '-')} is retired: it counted words, not tokens, and a word is 1.3 "
            f"tokens on one model and 2.5 on another; give the length in words with {words} (the "
            "upstream's token counts are printed with the results)",
        )
    if args.workload is not None:
        _size_from_workload(args, named_workload(args.workload))
    lengths = {}
    for flag, text in (
        ("--prompt-words", args.prompt_words),
        ("--output-tokens", args.output_tokens),
        ("--long-prompt-words", args.long_prompt_words),
    ):
        try:
            lengths[flag] = LengthDist.parse(text)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    check(
        math.isfinite(args.step_seconds) and args.step_seconds >= 0,
        f"--step-seconds: must be >= 0, got {args.step_seconds}",
    )
    check(args.step_requests >= 1, f"--step-requests: must be >= 1, got {args.step_requests}")
    check(
        1 <= args.completions_per_slot <= 100,
        f"--completions-per-slot: must be 1..100, got {args.completions_per_slot}",
    )
    check(args.min_completions >= 1, f"--min-completions: must be >= 1, got {args.min_completions}")
    check(0 <= args.long_share <= 1, f"--long-share: must be in [0, 1], got {args.long_share}")
    check(finite_positive(args.max_seconds), f"--max-seconds: must be > 0, got {args.max_seconds}")
    check(
        args.max_seconds > args.step_seconds,
        f"--max-seconds {args.max_seconds:g} is too short: a level's window lasts at least "
        f"--step-seconds {args.step_seconds:g}",
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
        batch_queue_wait=batch_queue_wait,
        prompt_words=lengths["--prompt-words"],
        output_tokens=lengths["--output-tokens"],
        long_share=args.long_share,
        long_prompt_words=lengths["--long-prompt-words"],
        step_seconds=args.step_seconds,
        step_requests=args.step_requests,
        completions_per_slot=args.completions_per_slot,
        min_completions=args.min_completions,
        max_seconds=args.max_seconds,
        request_timeout=args.request_timeout,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        max_error_ratio=args.max_error_rate,
        repeats=args.repeats,
        tolerance=args.tolerance,
        out=Path(args.out),
        json=args.json,
        write_config=None if args.write_config is None else Path(args.write_config),
    )


def _size_from_workload(args: argparse.Namespace, workload: NamedWorkload) -> None:
    """Each length flag still at its default takes ``workload``'s value (prompt tokens as words)."""
    defaults = build_parser()
    flags = workload.calibrate_flags(tokens_per_word=1.0)
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        dest = flag[2:].replace("-", "_")
        if getattr(args, dest) == defaults.get_default(dest):
            setattr(args, dest, float(value) if dest == "long_share" else value)


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

    progress(
        f"{PROG}: a probe request first sizes the steps and prints the plan; the whole run stops "
        f"within --max-seconds {config.max_seconds:g} ({duration_text(config.max_seconds)})"
    )

    try:
        outcome = asyncio.run(run_ramp(config, clock=time.monotonic, progress=progress))
    except CalibrateError as exc:
        print(f"{PROG}: {exc}", file=err)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=err)
        return 130
    _judge_across_runs(outcome, err)
    if outcome.steps:
        try:
            outcome.png = plot(outcome, config.out / PNG_NAME)
        except MissingLabExtraError as exc:  # the measurement stands without its picture
            print(f"{PROG}: {PNG_NAME} not written: {exc}", file=err)
        except OSError as exc:
            print(f"{PROG}: cannot write {config.out / PNG_NAME}: {exc}", file=err)
    written = _write_config(outcome, err)
    if config.json:
        print(json.dumps(to_json(outcome), indent=2), file=out)
    else:
        print(render_text(outcome), file=out)
    if not written:
        return 1
    return 0 if outcome.recommendation is not None else 1


def _judge_across_runs(outcome: Outcome, err: TextIO) -> None:
    """Set the confidence from this run and the previous one of the same setup in ``--out``
    (:mod:`~llm_backoff_shim.lab.calibrate.history`), and keep this run there for the next."""
    rec = outcome.recommendation
    knee = outcome.knee
    if rec is None or knee.level is None:
        return
    cfg = outcome.config
    record = RunRecord(
        at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        upstream=outcome.upstream,
        model=outcome.model,
        ttft_slo=cfg.ttft_slo,
        tpot_slo=cfg.tpot_slo,
        mix=cfg.describe_mix(),
        max_concurrency=rec.max_concurrency,
        max_queue_wait=rec.max_queue_wait,
        knee_tokens_per_s=float(statistics.median(s.output_tokens_per_s for s in outcome.runs[knee.level])),
        max_inflight_tokens=rec.max_inflight_tokens,
    )
    path = cfg.out / HISTORY_NAME
    earlier = previous(load(path), record)
    outcome.own_confidence = (knee.confidence, outcome.confidence_reason)
    outcome.previous_run = earlier
    level, why = across_runs(knee.confidence, outcome.confidence_reason, record, earlier, str(path))
    outcome.knee = replace(knee, confidence=level)
    outcome.confidence_reason = why
    try:
        append(path, record)
    except OSError as exc:
        print(f"{PROG}: cannot keep this run in {path} for the next one: {exc.strerror or exc}", file=err)


def _write_config(outcome: Outcome, err: TextIO) -> bool:
    """Write ``--write-config``'s file; False if it was asked for and could not be written."""
    path = outcome.config.write_config
    text = recommended_config(outcome)
    if path is None:
        return True
    if text is None:
        print(f"{PROG}: no recommendation, {path} not written", file=err)
        return True
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"{PROG}: cannot write {path}: {exc.strerror or exc}", file=err)
        return False
    print(f"{PROG}: wrote {path} (llm-backoff-shim serve --config {path})", file=err)
    return True
