"""The overload benchmark: the same seeded load, several client/proxy set-ups, side by side.

    .venv/bin/python bench/bench_overload.py            # ~15 min: burst 200, 2x for 30 s, 1.2x for 30 s
    .venv/bin/python bench/bench_overload.py --quick    # ~2 min: smaller loads, same shape
    .venv/bin/python bench/bench_overload.py --fixed-lengths   # every answer 20 tokens, 1.2 s

Every call draws its prompt and answer length (``max_tokens``, ``ignore_eos``) from
``--prompt-words`` / ``--output-tokens`` (lognormal by default: answers of median 64
tokens, at most 512), against the simulator with 8 slots at 100 tokens/s per sequence
(the demo's engine). ``--fixed-lengths`` runs the fixed load the earlier figures were
measured with: 8 slots, 1.2 s per request, 6.67 requests/s. 30 s deadline per call.
Set-ups per scenario:

- direct + plain openai: ``AsyncOpenAI`` (2 retries) straight at the engine;
- shim + plain openai;
- shim + llm_backoff: ``wrap(AsyncOpenAI(...), RetryPolicy(deadline=30), budget=...)``;
- haproxy + plain openai: HAProxy in front with ``maxconn 8`` and a timed queue
  (``timeout queue`` = the shim's queue wait), when ``haproxy`` is installed; skipped
  with a printed reason otherwise.

Every server is a child process on loopback; the load generator is
``llm_backoff_shim.lab.loadgen`` (the demo's). Prints progress, a table per cell, a
comparison per scenario, the targets of the issue checked against the
shim + llm_backoff cells, writes one PNG per scenario and a Markdown section.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from _wire import WireCapture, WireExchange, capture_unavailable
from llm_backoff_shim.lab.demo import ProgressLine, shim_flags
from llm_backoff_shim.lab.figures import REJECTION_WHEN, Figures, figures, percentile, rejections_by_when
from llm_backoff_shim.lab.load_records import RunResult, attach_shim_times, attempt_id
from llm_backoff_shim.lab.loadgen import LoadRun, run_load
from llm_backoff_shim.lab.plots import save_plot
from llm_backoff_shim.lab.procs import (
    ChildServer,
    ServerStartError,
    shim_server,
    sigterm_as_interrupt,
    sim_server,
)
from llm_backoff_shim.lab.report import comparison, table
from llm_backoff_shim.lab.scenario import (
    DEMO_SHAPE,
    DIRECT_PLAIN,
    SHIM_BACKOFF,
    SHIM_PLAIN,
    EngineShape,
    Scenario,
    Setup,
    arrivals,
)
from llm_backoff_shim.lab.workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, LengthDist, Workload

HAPROXY_PLAIN = Setup("haproxy + plain openai", "peer", "plain")
SETUPS: tuple[Setup, ...] = (DIRECT_PLAIN, SHIM_PLAIN, SHIM_BACKOFF, HAPROXY_PLAIN)
TTFT_BUDGET = 10.0
ACCESS_LOG_FLAGS = ("--log-level", "info", "--log-format", "json")


def scenarios(quick: bool) -> list[Scenario]:
    if quick:
        return [
            Scenario(
                "burst", burst=60, rate_factor=0, duration=0, deadline=10, ttft_budget=5, start_deadline=False
            ),
            Scenario("poisson-2x", burst=0, rate_factor=2.0, duration=10, deadline=10, ttft_budget=5),
            Scenario("poisson-1.2x", burst=0, rate_factor=1.2, duration=10, deadline=10, ttft_budget=5),
        ]
    return [
        # The burst is defined by a 30 s deadline per call and judged by success within
        # it; a TTFT budget belongs to the 2x target. With a 10 s budget to begin, 140 interactive
        # callers at once cannot all start (the engine starts ~67 in 10 s): --start-deadline-everywhere.
        Scenario(
            "burst",
            burst=200,
            rate_factor=0,
            duration=0,
            deadline=30,
            ttft_budget=TTFT_BUDGET,
            start_deadline=False,
        ),
        Scenario("poisson-2x", burst=0, rate_factor=2.0, duration=30, deadline=30, ttft_budget=TTFT_BUDGET),
        Scenario("poisson-1.2x", burst=0, rate_factor=1.2, duration=30, deadline=30, ttft_budget=TTFT_BUDGET),
    ]


# -- the peer ---------------------------------------------------------------------------------


def haproxy_config(port: int, upstream_port: int, queue_timeout: float, slots: int) -> str:
    return f"""global
    maxconn 4096

defaults
    mode http
    timeout connect 5s
    timeout client 120s
    timeout server 120s
    timeout queue {int(queue_timeout * 1000)}ms

frontend fe
    bind 127.0.0.1:{port}
    default_backend engine

backend engine
    server sim 127.0.0.1:{upstream_port} maxconn {slots}
"""


def haproxy_server(upstream: ChildServer, workdir: Path, queue_timeout: float, slots: int) -> ChildServer:
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"

    def command(port: int) -> list[str]:
        path = workdir / f"haproxy-{port}.cfg"
        path.write_text(haproxy_config(port, upstream.port, queue_timeout, slots))
        return [binary, "-db", "-f", str(path)]

    return ChildServer("haproxy", command)


def peer_missing() -> str | None:
    if shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists():
        return "haproxy is not installed (apt-get install haproxy)"
    return None


# -- running ----------------------------------------------------------------------------------


@dataclass
class Cell:
    scenario: Scenario
    figures: Figures


def run_scenario(
    scenario: Scenario,
    shape: EngineShape,
    setups: Sequence[Setup],
    seed: int,
    workdir: Path,
    loads: list[float],
    access_logs: Path | None = None,
    *,
    pin_front: bool = False,
) -> list[tuple[RunResult, Figures]]:
    capacity = shape.capacity_for(scenario.workload)
    calls = arrivals(scenario, capacity, random.Random(seed))
    print(f"\n### {scenario.name}: {len(calls)} calls, {scenario.describe(capacity)}", flush=True)
    results: list[tuple[RunResult, Figures]] = []
    with sim_server(shape.sim_flags()) as sim:
        for setup in setups:
            front: ChildServer | None = None
            if setup.route == "shim":
                # The JSON access log gives the shim's own time for each attempt (x-request-id).
                front = shim_server(sim, [*shim_flags(shape, scenario, hold_batch=False), *ACCESS_LOG_FLAGS])
            elif setup.route == "peer":
                front = haproxy_server(sim, workdir, scenario.ttft_budget, shape.slots)
            with contextlib.ExitStack() as stack:
                if front is not None:
                    stack.enter_context(front)
                    if pin_front and front.pid is not None:
                        stack.callback(pin_apart(front.pid, sim.pid))
                load = os.getloadavg()[0]
                loads.append(load)
                print(
                    f"- {setup.label} (machine load average {load:.1f} on {os.cpu_count()} CPUs)", flush=True
                )
                line = ProgressLine(sys.stderr, f"{scenario.name} / {setup.label}")
                run = LoadRun(
                    setup,
                    scenario,
                    calls,
                    target_url=sim.url if front is None else front.url,
                    engine_url=sim.url,
                    shim_url=front.url if setup.route == "shim" and front is not None else None,
                    capacity=capacity,
                    progress=line,
                    start_deadline=scenario.start_deadline,
                    token_capacity=shape.token_capacity_for(scenario.workload),
                )
                with contextlib.ExitStack() as capture:
                    wire = None
                    if setup.route == "shim" and front is not None and capture_unavailable() is None:
                        wire = capture.enter_context(WireCapture(urllib.parse.urlsplit(front.url).port or 80))
                    result = run_load(run)
                line.done()
                when = None
                if setup.route == "shim" and front is not None:
                    log = front.log_tail(limit=1 << 40)
                    attach_shim_times(result.calls, log)
                    # How often the recheck (the safety net for estimator error) still fires.
                    when = rejections_by_when(log)
                    if access_logs is not None:
                        name = f"{scenario.name}-{setup.label.replace(' + ', '-').replace(' ', '-')}.log"
                        (access_logs / name).write_text(log)
            figs = dataclasses.replace(figures(result), shim_rejections_by_when=when)
            if setup.route == "shim" and wire is not None:
                figs = with_wire_times(figs, result, wire.exchanges())
            results.append((result, figs))
            print(table(figs) + f"\n  (run took {result.elapsed:.1f} s)", flush=True)
    return results


def pin_apart(front: int, engine: int | None) -> Callable[[], None]:
    """The proxy on the last CPU, everything else (this load generator, the engine) on the others;
    returns what puts this process and the engine back as they were (the next set-up starts as
    unpinned as the first).

    As deployed: the shim has a core of its own beside the engine, and its callers are other
    machines. Unpinned on 2 CPUs, a burst's callers (200 openai calls built at once in this
    process) take the CPU the shim needs to answer them. Linux only.
    """
    mine = os.sched_getaffinity(0)
    cpus = sorted(mine)
    if len(cpus) < 2:
        return lambda: None
    theirs = os.sched_getaffinity(engine) if engine is not None else None
    rest = set(cpus[:-1])
    os.sched_setaffinity(front, {cpus[-1]})
    os.sched_setaffinity(0, rest)
    if engine is not None:
        os.sched_setaffinity(engine, rest)

    def restore() -> None:
        os.sched_setaffinity(0, mine)
        if engine is not None and theirs is not None:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(engine, theirs)

    return restore


def with_wire_times(figs: Figures, result: RunResult, exchanges: Sequence[WireExchange]) -> Figures:
    """``figs`` with the p99 time to rejection on the wire, over the rejected attempts matched."""
    on_wire = {e.request_id: e for e in exchanges}
    times = [
        on_wire[key].seconds
        for call in result.calls
        for attempt in call.attempts
        if attempt.rejected and (key := attempt_id(call.index, attempt.number)) in on_wire
    ]
    return dataclasses.replace(figs, wire_rejection_p99=percentile(times, 99), wire_rejections=len(times))


# -- the shim's own time to reject, without a load generator competing for the CPU ----------------


def rejection_probe(shape: EngineShape, probes: int) -> tuple[float, float, float, int]:
    """p50/p99/max seconds for the shim to refuse a request when slots and queue are full.

    The load generator of the scenarios measures from its own event loop, which on a busy
    2-core machine adds its lag to every answer. Here one client sends ``probes`` requests
    one after another over a kept-alive connection to a shim whose 8 slots and 16 queue
    places are held by requests the engine never finishes, and times each 429.
    """
    import asyncio

    import httpx2

    slow = EngineShape(slots=shape.slots, ttft=600.0, itl=shape.itl, output_tokens=shape.output_tokens)
    flags = [
        "--max-concurrency",
        str(shape.slots),
        "--max-queue",
        str(2 * shape.slots),
        "--max-queue-wait",
        "600",
    ]
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "stream": True}
    # The holders say they are retries: part of the queue is kept for returning callers.
    returning = {"x-stainless-retry-count": "1"}

    async def probe(url: str) -> tuple[list[float], int]:
        async with (
            httpx2.AsyncClient(base_url=url, timeout=30.0) as hold,
            httpx2.AsyncClient(base_url=url) as c,
        ):
            holders = [
                asyncio.create_task(hold.post("/v1/chat/completions", json=body, headers=returning))
                for _ in range(3 * shape.slots)
            ]
            while True:  # until the shim's slots and queue are all taken
                state = (await c.get("/shim/state")).json()
                held = sum(v["in_flight"] + v["queued"] for v in state["classes"].values())
                if held >= 3 * shape.slots:
                    break
                await asyncio.sleep(0.05)
            times: list[float] = []
            other = 0
            for _ in range(probes):
                t0 = time.perf_counter()
                response = await c.post("/v1/chat/completions", json=body)
                times.append(time.perf_counter() - t0)
                other += response.status_code != 429
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return times, other

    with sim_server(slow.sim_flags()) as sim, shim_server(sim, flags) as shim:
        times, other = asyncio.run(probe(shim.url))
    times.sort()
    p50 = times[len(times) // 2]
    p99 = times[max(0, int(len(times) * 0.99) - 1)]
    return p50, p99, times[-1], other


# -- targets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    scenario: str
    text: str
    check: Callable[[Figures], bool | None]


def _le(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _ge(value: float | None, limit: float) -> bool | None:
    return None if value is None else value >= limit


TARGETS: tuple[Target, ...] = (
    Target("burst", "success within deadline >= 95%", lambda f: f.success_rate >= 0.95),
    Target("burst", "<= 2 HTTP attempts per request on average", lambda f: f.attempts / f.calls <= 2.0),
    Target("burst", "<= 10 retries in any 100 ms window", lambda f: f.retry_wave <= 10),
    Target("poisson-2x", "goodput >= 95% of capacity", lambda f: f.goodput_fraction >= 0.95),
    Target("poisson-2x", "interactive p99 TTFT within its budget", lambda f: _le(f.ttft_p99, f.ttft_budget)),
    Target("*", "p99 time to rejection <= 10 ms", lambda f: _le(f.rejection_p99, 0.010)),
    Target("*", "zero wasted engine work", lambda f: f.wasted_tokens == 0),
    Target("*", ">= 80% admitted on their first retry", lambda f: _ge(f.first_retry_admitted, 0.8)),
    Target(
        "poisson-2x",
        "those not served fail fast with a typed error (no deadline timeouts)",
        lambda f: f.failed_deadline == 0,
    ),
    Target("poisson-2x", "useful tokens >= 85% of the ceiling", lambda f: _ge(f.useful_fraction, 0.85)),
    Target("poisson-2x", ">= 80% of batch served within its deadline", lambda f: _ge(f.batch_served, 0.8)),
    Target("poisson-2x", "failures known within p90 <= 1 s", lambda f: _le(f.failure_p90, 1.0)),
)


def check_targets(cells: Sequence[Cell]) -> list[tuple[str, str, str, str]]:
    rows = []
    for target in TARGETS:
        for cell in cells:
            if cell.figures.label != SHIM_BACKOFF.label:
                continue
            if target.scenario not in ("*", cell.scenario.name):
                continue
            verdict = target.check(cell.figures)
            mark = "n/a" if verdict is None else ("met" if verdict else "MISSED")
            rows.append((cell.scenario.name, target.text, mark, _evidence(target.text, cell.figures)))
    return rows


def _evidence(text: str, f: Figures) -> str:
    if "useful" in text:
        share = "-" if f.useful_fraction is None else f"{f.useful_fraction:.0%}"
        return f"{f.useful_tokens} of {f.useful_ceiling or 0:.0f} = {share}"
    if "batch served" in text:
        share = "-" if f.batch_served is None else f"{f.batch_served:.0%}"
        return f"{f.batch_ok}/{f.batch_calls} = {share}"
    if "failures known" in text:
        return f"p90 {_s(f.failure_p90)}"
    if "success" in text:
        return f"{f.ok}/{f.calls} = {f.success_rate:.1%}"
    if "attempts" in text:
        return f"{f.attempts}/{f.calls} = {f.attempts / f.calls:.2f}"
    if "retries in any" in text:
        return f"{f.retry_wave}"
    if "goodput" in text:
        return f"{f.goodput_fraction:.1%}"
    if "TTFT" in text:
        return (
            f"p99 {f.ttft_p99 if f.ttft_p99 is None else round(f.ttft_p99, 2)} s, budget {f.ttft_budget:g} s"
        )
    if "rejection" in text:
        if f.rejection_p99 is None:
            return "-"
        more = []
        if f.rejection_from_head_p99 is not None:
            more.append(f"from the request's head: {f.rejection_from_head_p99 * 1000:.1f} ms")
        if f.shim_rejection_p99 is not None:
            more.append(f"inside the shim: {f.shim_rejection_p99 * 1000:.1f} ms")
        if f.shim_rejection_after_body_p99 is not None:
            more.append(f"inside the shim after the body: {f.shim_rejection_after_body_p99 * 1000:.1f} ms")
        if f.wire_rejection_p99 is not None:
            more.append(f"on the wire: {f.wire_rejection_p99 * 1000:.1f} ms")
        return f"{f.rejection_p99 * 1000:.1f} ms" + (f" ({'; '.join(more)})" if more else "")
    if "wasted" in text:
        return f"{f.wasted_tokens} tokens ({f.wasted_fraction:.1%})"
    if "first retry" in text:
        share = "-" if f.first_retry_admitted is None else f"{f.first_retry_admitted:.0%}"
        return f"{share} of {f.first_retries}"
    return f"{f.failed_fast} fast, {f.failed_deadline} at deadline"


# -- output -------------------------------------------------------------------------------------


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 0.1 else f"{value:.2f} s"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def markdown_cells(scenario: Scenario, cells: Sequence[Figures]) -> str:
    header = "| figure | " + " | ".join(f.label for f in cells) + " |"
    rule = "|---|" + "---:|" * len(cells)
    rows = [
        (
            "useful tokens (of the ceiling)",
            [
                f"{f.useful_tokens}" + ("" if f.useful_fraction is None else f" ({f.useful_fraction:.0%})")
                for f in cells
            ],
        ),
        (
            "interactive within TTFT budget",
            [f"{f.interactive_within_budget}/{f.interactive_calls}" for f in cells],
        ),
        ("batch served", [f"{f.batch_ok}/{f.batch_calls}" for f in cells]),
        (
            "failures known < 1 s / p90",
            [f"{_share(f.failed_fast_share)} / {_s(f.failure_p90)}" for f in cells],
        ),
        ("engine tokens wasted", [f"{f.wasted_fraction:.1%}" for f in cells]),
        ("success within deadline", [f"{f.ok}/{f.calls} = {f.success_rate:.0%}" for f in cells]),
        ("interactive TTFT p50 / p99", [f"{_s(f.ttft_p50)} / {_s(f.ttft_p99)}" for f in cells]),
        ("p99 time to rejection, caller-side", [f"{_s(f.rejection_p99)} (n={f.rejections})" for f in cells]),
        ("  same, from the request's head", [_s(f.rejection_from_head_p99) for f in cells]),
        (
            "p99 time to rejection on the wire (request's last byte to answer's first)",
            [_s(f.wire_rejection_p99) for f in cells],
        ),
        (
            "p99 time to rejection, inside the shim after the request's body",
            [_s(f.shim_rejection_after_body_p99) for f in cells],
        ),
        (
            "rejections answered from the request's head (before its body)",
            [str(f.shim_refused_from_head) if f.shim_rejections_matched else "-" for f in cells],
        ),
        (
            "p99 time to rejection, inside the shim (access log)",
            [
                "-"
                if not f.shim_rejections_matched
                else f"{_s(f.shim_rejection_p99)} (n={f.shim_rejections_matched})"
                for f in cells
            ],
        ),
        (
            "attempts per success",
            ["-" if f.attempts_per_success is None else f"{f.attempts_per_success:.2f}" for f in cells],
        ),
        (
            "shim's rejections at arrival / recheck / timer / head",
            [
                "-"
                if f.shim_rejections_by_when is None
                else " / ".join(str(f.shim_rejections_by_when[k]) for k in REJECTION_WHEN)
                for f in cells
            ],
        ),
        ("attempts per call", [f"{f.attempts / f.calls:.2f}" for f in cells]),
        ("goodput / capacity", [f"{f.goodput_fraction:.1%}" for f in cells]),
        ("wasted engine work (tokens)", [f"{f.wasted_fraction:.0%} ({f.wasted_tokens})" for f in cells]),
        ("largest retry wave (per 100 ms)", [str(f.retry_wave) for f in cells]),
        (
            "admitted on first retry",
            [
                "-"
                if f.first_retry_admitted is None
                else f"{f.first_retry_admitted:.0%} of {f.first_retries}"
                for f in cells
            ],
        ),
        (
            "failed fast / at deadline (of which mid-stream)",
            [f"{f.failed_fast} / {f.failed_deadline} ({f.deadline_while_served})" for f in cells],
        ),
        (
            "peak queue engine / proxy",
            [
                f"{f.engine_peak_waiting} / {'-' if f.proxy_peak_queued is None else f.proxy_peak_queued}"
                for f in cells
            ],
        ),
    ]
    lines = [f"#### {scenario.name}: {scenario.describe(cells[0].capacity)}", "", header, rule]
    lines += [f"| {name} | " + " | ".join(values) + " |" for name, values in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller loads (10 s instead of 30 s)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for PNGs and JSON")
    p.add_argument("--only", default="", help="comma-separated scenario names to run (default: all)")
    p.add_argument("--probe-only", action="store_true", help="only measure the shim's own time to reject")
    p.add_argument("--keep-logs", action="store_true", help="write each shim's access log into --out")
    p.add_argument(
        "--pin",
        action="store_true",
        help="the shim (or peer) on a CPU of its own, the load generator and engine on the others "
        "(as deployed; Linux)",
    )
    p.add_argument(
        "--setups",
        default="",
        help="comma-separated set-ups to run: direct, shim-plain, shim-backoff, haproxy (default: all)",
    )
    deadlines = p.add_mutually_exclusive_group()
    deadlines.add_argument(
        "--no-start-deadline",
        action="store_true",
        help="interactive llm_backoff callers without RetryPolicy(start_deadline=TTFT budget) in "
        "every scenario (for before/after comparisons)",
    )
    deadlines.add_argument(
        "--start-deadline-everywhere",
        action="store_true",
        help="interactive llm_backoff callers state their TTFT budget in every scenario, the burst "
        "included; by default the burst's callers have the call's deadline only",
    )
    p.add_argument(
        "--prompt-words",
        default=str(DEFAULT_PROMPT_WORDS),
        help="prompt length in words per call: N, LOW-HIGH or lognormal:MEDIAN:SIGMA[:LOW-HIGH] "
        "(default %(default)s)",
    )
    p.add_argument(
        "--output-tokens",
        default=str(DEFAULT_OUTPUT_TOKENS),
        help="max_tokens per call (ignore_eos), same forms (default %(default)s)",
    )
    p.add_argument(
        "--fixed-lengths",
        action="store_true",
        help="the fixed load of the earlier figures: a short prompt, every answer 20 tokens, 1.2 s",
    )
    args = p.parse_args(argv)
    workload: Workload | None = None
    if args.fixed_lengths:
        shape = EngineShape()
    else:
        try:
            workload = Workload(LengthDist.parse(args.prompt_words), LengthDist.parse(args.output_tokens))
        except ValueError as exc:
            p.error(str(exc))
        shape = DEMO_SHAPE
    chosen = [dataclasses.replace(s, workload=workload) for s in scenarios(args.quick)]
    if args.no_start_deadline or args.start_deadline_everywhere:
        chosen = [dataclasses.replace(s, start_deadline=args.start_deadline_everywhere) for s in chosen]
    if args.only:
        wanted = set(args.only.split(","))
        chosen = [s for s in chosen if s.name in wanted]
        if not chosen:
            p.error(f"--only {args.only}: no such scenario")
    setups = list(SETUPS)
    if args.setups:
        names = dict(zip(("direct", "shim-plain", "shim-backoff", "haproxy"), SETUPS, strict=True))
        unknown = set(args.setups.split(",")) - set(names)
        if unknown:
            p.error(f"--setups: unknown {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
        setups = [names[n] for n in args.setups.split(",")]
    missing = peer_missing() if HAPROXY_PLAIN in setups else None
    if missing:
        print(f"peer skipped: {missing}", flush=True)
        setups.remove(HAPROXY_PLAIN)
    print(
        f"Engine: {shape.slots} slots, {shape.service_time_for(workload):.2f} s per request, "
        f"capacity {shape.capacity_for(workload):.2f}/s ({shape.token_capacity_for(workload):.0f} answer "
        "tokens/s); "
        f"shim flags: {' '.join(shim_flags(shape, chosen[0], hold_batch=False))}",
        flush=True,
    )
    if args.probe_only:
        p50, p99, worst, other = rejection_probe(shape, 500)
        print(
            f"p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms, max {worst * 1000:.2f} ms, non-429: {other}"
        )
        return 0
    started = time.monotonic()
    cells: list[Cell] = []
    markdown: list[str] = []
    loads: list[float] = []
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    try:
        with sigterm_as_interrupt(), tempfile.TemporaryDirectory() as tmp:
            for scenario in chosen:
                ran = run_scenario(
                    scenario,
                    shape,
                    setups,
                    args.seed,
                    Path(tmp),
                    loads,
                    args.out if args.keep_logs else None,
                    pin_front=args.pin,
                )
                results = [r for r, _ in ran]
                figs = [f for _, f in ran]
                cells += [Cell(scenario, f) for f in figs]
                print(f"\n{scenario.name}, side by side:\n{comparison(figs)}", flush=True)
                png = save_plot(
                    results,
                    args.out / f"overload-{scenario.name}{suffix}.png",
                    title=f"overload benchmark, {scenario.name}: "
                    f"{scenario.describe(shape.capacity_for(workload))}",
                )
                print(f"plot: {png}", flush=True)
                markdown.append(markdown_cells(scenario, figs) + f"\n\n![{scenario.name}]({png.name})")
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130
    except ServerStartError as exc:
        print(f"bench_overload: {exc}", file=sys.stderr)
        return 1
    p50, p99, worst, other = rejection_probe(shape, 50 if args.quick else 500)
    probe_line = (
        f"Shim refusing with slots and queue full, one client, sequential requests on loopback "
        f"({50 if args.quick else 500} probes): p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms, "
        f"max {worst * 1000:.2f} ms; {other} answers were not 429."
    )
    print("\n" + probe_line, flush=True)
    rows = check_targets(cells)
    print("\nTargets (shim + llm_backoff cells):")
    for scenario_name, text, mark, evidence in rows:
        print(f"  [{mark:>6}] {scenario_name:<13} {text}: {evidence}")
    md_targets = ["| scenario | target | result | measured |", "|---|---|---|---|"]
    md_targets += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    load_note = (
        f"Machine load average (1 min) when each cell started: {min(loads):.1f} to {max(loads):.1f} "
        f"on {os.cpu_count()} CPUs."
    )
    report = "\n\n".join([load_note, *markdown, probe_line]) + "\n\n" + "\n".join(md_targets) + "\n"
    (args.out / f"overload-bench{suffix}.md").write_text(report)
    (args.out / f"overload-bench{suffix}.json").write_text(
        json.dumps([{"scenario": c.scenario.name, **c.figures.as_dict()} for c in cells], indent=1) + "\n"
    )
    print(f"\nMarkdown: {args.out / f'overload-bench{suffix}.md'}")
    print(f"Total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
