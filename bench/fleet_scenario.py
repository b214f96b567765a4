"""The scoreboard's ``fleet`` scenario: three replicas behind nginx and HAProxy, as shipped.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/scoreboard.py --engine sim --scenarios fleet

Three simulated engines (8 slots each), a shim beside each (sharing a Redis with
``--fleet-retry-after``, as docs/deploy.md sets a fleet up), behind Debian's nginx and HAProxy
running the shipped configurations (:class:`~llm_backoff_shim.lab.fleet.Fleet`), on one seeded
trace at 2x the fleet's capacity (``real_vllm.mix.chat_scenario``: 70 % interactive with a 5 s
time-to-first-token budget, 20 s deadline). Always simulated engines, also with ``--engine vllm``:
three CPU vLLMs do not fit two cores. Per caller (plain openai, the SDK's presets):

- **three lone replicas** (the reference): the trace dealt at random into thirds
  (:func:`~llm_backoff_shim.lab.fleet_measures.split_trace`), each third played at the same time
  against its own replica (engine and shim, no balancer);
- per balancer, a **clean run** of the whole trace, a Prometheus evaluating the shipped rules
  file beside it: useful tokens and interactive calls within budget over the three lone
  replicas', the refused attempts asked of every replica and those refused while a replica
  had a free slot (the shims' JSON access logs), the rejected share as the shipped recording
  rule computes it against the share of callers' attempts refused;
- per balancer, a **faulted run** of the same trace: one replica's engine killed at a fifth
  of the arrivals and started again a second later (its shim left up), then, from about
  half-way, each shim restarted in turn as docs/deploy.md says (SIGTERM, wait for it to exit,
  start it, wait for its /ready, and with HAProxy for the balancer to mark it UP): callers
  whose final answer came from the dead replica, streams the death cut, calls the restart lost
  and how long it took.

The figures are pure and tested without load (:mod:`llm_backoff_shim.lab.fleet_measures`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench_admission_model import Job, job, schedule
from llm_backoff_shim.lab.demo import ProgressLine, shim_flags
from llm_backoff_shim.lab.figures import figures
from llm_backoff_shim.lab.fleet import Fleet
from llm_backoff_shim.lab.fleet_configs import lb_binary
from llm_backoff_shim.lab.fleet_measures import (
    Visit,
    conservation,
    dead_replica_answers,
    how_they_ended,
    lost_calls,
    refused_share,
    refused_with_room,
    requeued_after_wait,
    split_trace,
    streams_cut,
    visits,
)
from llm_backoff_shim.lab.load_records import Progress, RunResult
from llm_backoff_shim.lab.loadgen import LoadRun, run_load
from llm_backoff_shim.lab.procs import free_port, shim_server, sim_server
from llm_backoff_shim.lab.prometheus import SHIPPED_RULES, prometheus_binary
from llm_backoff_shim.lab.scenario import Arrival, EngineShape, Scenario, Setup, arrivals
from llm_backoff_shim.serve.observe.access_log import json_records
from real_vllm.mix import chat_scenario

REPLICAS = 3
SLOTS = 8
RATE_FACTOR = 2.0
BALANCERS = ("nginx", "haproxy")
BALANCER_LABELS = {"nginx": "nginx", "haproxy": "HAProxy"}
CALLERS = {
    "plain": Setup("plain openai", "shim", "plain"),
    "presets": Setup("llm_backoff presets", "shim", "llm_backoff_presets"),
}
#: The shims' access logs, read for every figure that follows a call across replicas.
LOG_FLAGS = ("--log-level", "info", "--log-format", "json")
#: The replica whose engine the faulted run kills, when (share of the arrivals' span), for how long.
KILLED = 1
KILL_AT = 0.2
DEAD_FOR = 1.0
#: The rolling restart begins at this share of the arrivals' span (and after the engine is back).
RESTART_AT = 0.45
#: Bounds on waiting for one restarted replica to be taken back (a broken run, not a slow one).
READY_TIMEOUT = 30.0

# -- the oracle ---------------------------------------------------------------------------------

#: Tokens the simulator counts for a prompt of ``w`` words: 1.3 per word plus the chat template's 4.
TOKENS_PER_WORD = 1.3
TEMPLATE_TOKENS = 4


def prompt_tokens(prompt: str | None) -> int:
    """The simulator's token count of a prompt (the load generator's fixed prompt when None)."""
    words = len((prompt or "call 0").split())
    return round(TOKENS_PER_WORD * words + TEMPLATE_TOKENS)


def oracle_jobs(calls: Sequence[Arrival], shape: EngineShape, scenario: Scenario) -> list[Job]:
    """The trace as ``bench_admission_model.schedule`` takes it: each call's answer length, its slot
    time on the simulator (first token ``ttft`` plus its prompt's prefill after the start, then one
    token per ``itl``) and the latest start that is still useful (its class's TTFT budget and
    deadline)."""
    jobs = []
    for call in calls:
        tokens = call.max_tokens or shape.output_tokens
        ttft = shape.ttft + prompt_tokens(call.prompt) * shape.prefill_time_per_token
        jobs.append(
            job(
                call.at,
                tokens,
                call.cls,
                ttft=ttft,
                itl=shape.itl,
                deadline=scenario.deadline_of(call.cls),
                ttft_budget=scenario.ttft_budget if call.cls == "interactive" else None,
            )
        )
    return jobs


# -- the shipped rules ----------------------------------------------------------------------------


def rejected_share_rule(rules: Mapping[str, Any]) -> str | None:
    """The recording rule of a Prometheus rules file (parsed) that gives the fleet's rejected
    share: the first ``job:`` record naming rejections and a ratio (any record naming both when
    no ``job:`` one does); None when the file has none."""
    names = [
        str(rule["record"])
        for group in rules.get("groups") or []
        for rule in group.get("rules") or []
        if "record" in rule and "reject" in str(rule["record"]) and "ratio" in str(rule["record"])
    ]
    fleet_level = [n for n in names if n.startswith("job:")]
    return (fleet_level or names or [None])[0]


def shipped_rejected_share_rule() -> str | None:
    import yaml

    data = yaml.safe_load(SHIPPED_RULES.read_text())
    return rejected_share_rule(data if isinstance(data, dict) else {})


# -- the runs -----------------------------------------------------------------------------------


class RunClock:
    """The load run's clock as seen from another thread: the run reports its time with each
    progress report, so the origin is known from the first report on."""

    def __init__(self, line: ProgressLine) -> None:
        self._line = line
        self._origin: float | None = None
        self._known = threading.Event()

    def __call__(self, p: Progress) -> None:
        if self._origin is None:
            self._origin = time.monotonic() - p.t
            self._known.set()
        self._line(p)

    def now(self) -> float:
        """Seconds on the run's clock (waits for the first report)."""
        self._known.wait()
        assert self._origin is not None
        return time.monotonic() - self._origin

    def sleep_until(self, t: float, stop: threading.Event) -> bool:
        """Wait until the run's clock reads ``t``; False when ``stop`` is set first."""
        while not self._known.wait(0.1):
            if stop.is_set():
                return False
        return not stop.wait(max(0.0, t - self.now()))


@dataclass
class Faults:
    """When the faulted run's faults happened: run clock (s) and wall clock (Unix s)."""

    killed: float | None = None
    killed_wall: float | None = None
    back: float | None = None
    back_wall: float | None = None
    restart_start: float | None = None
    restart_end: float | None = None
    error: str | None = None


def _wait_taken_back(fleet: Fleet, i: int) -> None:
    """Until replica ``i``'s /ready answers 200 and, with HAProxy, the balancer shows it UP."""
    deadline = time.monotonic() + READY_TIMEOUT
    with httpx.Client(timeout=1.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(fleet.shim_urls[i] + "/ready").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"shim {i} not ready {READY_TIMEOUT:g} s after its start")
            time.sleep(0.05)
    lb = fleet.lb
    while lb is not None and lb.lb == "haproxy" and lb.server_states()[i] != "UP":
        if time.monotonic() > deadline:
            raise TimeoutError(f"HAProxy did not take replica {i} back within {READY_TIMEOUT:g} s")
        time.sleep(0.05)


def inject(fleet: Fleet, clock: RunClock, span: float, faults: Faults, stop: threading.Event) -> None:
    """The faulted run's faults, on the run's clock: the engine kill, then the rolling restart."""
    try:
        if not clock.sleep_until(KILL_AT * span, stop):
            return
        fleet.kill_engine(KILLED)
        faults.killed, faults.killed_wall = clock.now(), time.time()
        time.sleep(DEAD_FOR)
        fleet.start_engine(KILLED)
        faults.back, faults.back_wall = clock.now(), time.time()
        if not clock.sleep_until(max(RESTART_AT * span, faults.back + 2.0), stop):
            return
        faults.restart_start = clock.now()
        for i in range(REPLICAS):
            fleet.stop_shim(i)
            fleet.start_shim(i)
            _wait_taken_back(fleet, i)
        faults.restart_end = clock.now()
    except Exception as exc:  # reported with the run's figures, not lost in a thread
        faults.error = f"{type(exc).__name__}: {exc}"


@dataclass
class Driven:
    """One load run: its records, every shim's visits, and the extras of its kind of run."""

    result: RunResult
    visits: list[Visit]
    faults: Faults | None = None
    rule_share: float | None = None
    rule: str | None = None


def _load_run(
    caller: str, scen: Scenario, calls: Sequence[Arrival], shape: EngineShape, progress: Any, **urls: Any
) -> LoadRun:
    replicas = len(urls.get("engine_urls") or ()) or 1
    return LoadRun(
        CALLERS[caller],
        scen,
        calls,
        capacity=replicas * shape.capacity_for(scen.workload),
        token_capacity=replicas * shape.token_capacity_for(scen.workload),
        progress=progress,
        start_deadline=False,
        **urls,
    )


@contextlib.contextmanager
def fleet_redis() -> Iterator[list[str]]:
    """A Redis for the fleet's shims, as docs/deploy.md sets a fleet up ("The fleet's
    Retry-After"): the shim flags that use it, or none when redis-server is not installed
    (the figures then count balancer tries, as a fleet without it does)."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield []
        return
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield ["--fleet-retry-after", "--redis-url", f"redis://127.0.0.1:{port}/0"]
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def drive_fleet(
    lb: str,
    caller: str,
    scen: Scenario,
    calls: Sequence[Arrival],
    shape: EngineShape,
    flags: Sequence[str],
    *,
    faulted: bool,
) -> Driven:
    """The whole trace through a fresh fleet behind ``lb``: clean (with a Prometheus evaluating
    the shipped rules) or with the faults of :func:`inject`."""
    rule = None if faulted else shipped_rejected_share_rule()
    watch = rule is not None and prometheus_binary() is not None
    with (
        fleet_redis() as shared,
        Fleet(
            REPLICAS,
            lb,
            sim_flags=shape.sim_flags(),
            shim_flags=[*flags, *shared, *LOG_FLAGS],
            prometheus=watch,
        ) as fleet,
    ):
        if fleet.prometheus is not None:
            fleet.prometheus.client.wait_up([r.address for r in fleet.replicas], timeout=30)
        kind = "engine kill, rolling restart" if faulted else "clean"
        line = ProgressLine(sys.stderr, f"fleet {BALANCER_LABELS[lb]} / {caller} ({kind})")
        clock = RunClock(line)
        run = _load_run(
            caller,
            scen,
            calls,
            shape,
            clock,
            target_url=fleet.url,
            engine_url=fleet.engine_urls[0],
            engine_urls=fleet.engine_urls,
            shim_urls=fleet.shim_urls,
        )
        faults, stop = Faults(), threading.Event()
        thread = threading.Thread(
            target=inject, args=(fleet, clock, max(c.at for c in calls), faults, stop), daemon=True
        )
        if faulted:
            thread.start()
        try:
            result = run_load(run)
        finally:
            stop.set()
            if faulted:
                thread.join()
        line.done()
        share = None
        if fleet.prometheus is not None and rule is not None:
            # Two evaluations after the last scrape of the run's counters.
            time.sleep(3 * fleet.prometheus.scrape_interval)
            share = fleet.prometheus.client.value(rule)
        seen = [v for i in range(REPLICAS) for v in visits(i, fleet.access_records(i))]
    return Driven(result, seen, faults if faulted else None, share, rule)


def drive_lone(
    caller: str, scen: Scenario, thirds: Sequence[Sequence[Arrival]], shape: EngineShape, flags: Sequence[str]
) -> list[Driven]:
    """Each third of the trace against its own replica (engine and shim), the three at once."""

    def one(part: Sequence[Arrival]) -> Driven:
        with sim_server(shape.sim_flags()) as sim, shim_server(sim, [*flags, *LOG_FLAGS]) as shim:
            run = _load_run(
                caller, scen, part, shape, None, target_url=shim.url, engine_url=sim.url, shim_url=shim.url
            )
            result = run_load(run)
            text = shim.log_tail(50_000_000)
        return Driven(result, visits(0, json_records(text)))

    print(f"  three lone replicas / {caller}: {', '.join(str(len(t)) for t in thirds)} calls", flush=True)
    with ThreadPoolExecutor(len(thirds)) as pool:
        return list(pool.map(one, thirds))


# -- the figures of one cell ----------------------------------------------------------------------


@dataclass
class FleetCell:
    """One balancer (``lone``: three lone replicas) and one kind of caller."""

    target: str
    caller: str
    calls: int
    useful_tokens: int
    interactive_calls: int
    interactive_within_budget: int
    batch_calls: int
    batch_ok: int
    oracle_useful: int
    refused_calls: int = 0
    refused_asked_all: int = 0
    refused_with_room: int = 0
    asked: dict[int, int] = dataclasses.field(default_factory=dict)
    requeued: int = 0
    rule_share: float | None = None
    callers_refused_share: float | None = None
    lost_clean: int = 0
    dead_answers: int | None = None
    streams_cut: int | None = None
    lost_to_kill: int | None = None
    lost_in_restart: int | None = None
    restart_seconds: float | None = None
    #: How the calls lost in the clean run and to each fault ended (:func:`how_they_ended`).
    lost_clean_ended: dict[str, int] = dataclasses.field(default_factory=dict)
    lost_to_kill_ended: dict[str, int] = dataclasses.field(default_factory=dict)
    lost_in_restart_ended: dict[str, int] = dataclasses.field(default_factory=dict)
    fault_error: str | None = None
    rule: str | None = None


def _counts(result: RunResult) -> dict[str, int]:
    f = figures(result)
    return {
        "calls": f.calls,
        "useful_tokens": f.useful_tokens,
        "interactive_calls": f.interactive_calls,
        "interactive_within_budget": f.interactive_within_budget,
        "batch_calls": f.batch_calls,
        "batch_ok": f.batch_ok,
    }


def lone_cell(caller: str, runs: Sequence[Driven], oracle_useful: int) -> FleetCell:
    counts = [_counts(r.result) for r in runs]
    summed = {k: sum(c[k] for c in counts) for k in counts[0]}
    cell = FleetCell("lone", caller, oracle_useful=oracle_useful, **summed)
    cell.callers_refused_share = refused_share([c for r in runs for c in r.result.calls])
    return cell


def fleet_cell(lb: str, caller: str, clean: Driven, faulted: Driven, oracle_useful: int) -> FleetCell:
    cell = FleetCell(lb, caller, oracle_useful=oracle_useful, **_counts(clean.result))
    refusals = refused_with_room(clean.visits, REPLICAS, SLOTS)
    cell.refused_calls, cell.refused_with_room = refusals.refused, refusals.with_room
    cell.refused_asked_all, cell.asked = refusals.asked_all, refusals.asked
    cell.requeued = requeued_after_wait(clean.visits).count
    cell.rule, cell.rule_share = clean.rule, clean.rule_share
    cell.callers_refused_share = refused_share(clean.result.calls)
    lost = lost_calls(clean.result.calls, 0.0, float("inf"))
    cell.lost_clean, cell.lost_clean_ended = len(lost), how_they_ended(clean.result.calls, lost)
    f = faulted.faults
    assert f is not None
    cell.fault_error = f.error
    calls = faulted.result.calls
    if f.killed_wall is not None and f.back_wall is not None:
        dead = dead_replica_answers(calls, faulted.visits, KILLED, f.killed_wall)
        cell.dead_answers = len(dead)
        cell.streams_cut = streams_cut(faulted.visits, KILLED, f.killed_wall, f.back_wall)
        if f.killed is not None and f.restart_start is not None and f.restart_end is not None:
            killed = {*dead, *lost_calls(calls, f.killed, f.restart_start)}
            cell.lost_to_kill, cell.lost_to_kill_ended = len(killed), how_they_ended(calls, killed)
            cell.restart_seconds = f.restart_end - f.restart_start
            restart = lost_calls(calls, f.restart_start, f.restart_end, besides=killed)
            cell.lost_in_restart, cell.lost_in_restart_ended = len(restart), how_they_ended(calls, restart)
    return cell


# -- the report -----------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> str:
    return "-" if b <= 0 else f"{a / b:.2f}"


def _share(part: int, whole: int) -> str:
    return "-" if whole <= 0 else f"{part}/{whole} ({part / whole:.0%})"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}" if value >= 0.1 or value == 0 else f"{value:.1%}"


def _two(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


HEADER = (
    "| balancer | callers | useful tokens: fleet / 3 lone replicas (oracle's) | interactive within "
    "budget: fleet / 3 lone | refused attempts asked of every replica | refused with a replica free "
    "| engine kill: answered by the dead replica / streams cut / calls lost | rolling restart: "
    "calls lost / seconds | rejected share: shipped rule / callers' attempts |"
)


def table(cells: Sequence[FleetCell]) -> str:
    lines = [HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for caller in CALLERS:
        lone = next((c for c in cells if c.target == "lone" and c.caller == caller), None)
        if lone is None:
            continue
        lines.append(
            f"| three lone replicas | {CALLERS[caller].label} | {lone.useful_tokens} tokens "
            f"(oracle {lone.oracle_useful}) | {lone.interactive_within_budget}/{lone.interactive_calls} "
            f"| | | | | - / {_pct(lone.callers_refused_share)} |"
        )
        for c in cells:
            if c.target == "lone" or c.caller != caller:
                continue
            conserved = _two(conservation(c.useful_tokens, lone.useful_tokens / REPLICAS, REPLICAS))
            oracle = _two(conservation(c.oracle_useful, lone.oracle_useful / REPLICAS, REPLICAS))
            restart = "-" if c.restart_seconds is None else f"{c.restart_seconds:.1f} s"
            lines.append(
                f"| {BALANCER_LABELS[c.target]} | {CALLERS[caller].label} "
                f"| {conserved} ({oracle}) "
                f"| {_ratio(c.interactive_within_budget, lone.interactive_within_budget)} "
                f"| {_share(c.refused_asked_all, c.refused_calls)} "
                f"| {c.refused_with_room}/{c.refused_calls} "
                f"| {_n(c.dead_answers)} / {_n(c.streams_cut)} / {_n(c.lost_to_kill)} "
                f"| {_n(c.lost_in_restart)} / {restart} "
                f"| {_pct(c.rule_share)} / {_pct(c.callers_refused_share)} |"
            )
    return "\n".join(lines)


def _of(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def plot(cells: Sequence[FleetCell], path: Path, title: str) -> None:
    from llm_backoff_shim.lab.extra import require_plotting

    require_plotting(f"the plot {path.name}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleet = [c for c in cells if c.target != "lone"]
    lone = {c.caller: c for c in cells if c.target == "lone"}
    labels = [f"{BALANCER_LABELS[c.target]}\n{c.caller}" for c in fleet]
    xs = range(len(fleet))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))

    def bars(ax: Any, series: Sequence[tuple[str, list[float]]], what: str, line: float | None) -> None:
        width = 0.8 / len(series)
        for j, (name, ys) in enumerate(series):
            ax.bar([x + (j - (len(series) - 1) / 2) * width for x in xs], ys, width, label=name)
        # Room above the bars for the legend.
        ax.set_ylim(0, 1.35 * max([1.0, *(y for _, ys in series for y in ys)]))
        if line is not None:
            ax.axhline(line, color="k", ls=":", lw=1)
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_title(what, fontsize=9)
        ax.legend(fontsize=7)

    def over_lone(c: FleetCell, attr: str) -> float:
        ref = getattr(lone[c.caller], attr) if c.caller in lone else 0
        return float(getattr(c, attr)) / ref if ref else 0.0

    bars(
        axes[0],
        [
            ("useful tokens", [over_lone(c, "useful_tokens") for c in fleet]),
            ("interactive within budget", [over_lone(c, "interactive_within_budget") for c in fleet]),
        ],
        "fleet / three lone replicas (target >= 0.95)",
        0.95,
    )
    bars(
        axes[1],
        [
            ("asked of every replica", [_of(c.refused_asked_all, c.refused_calls) for c in fleet]),
            ("refused with a replica free", [_of(c.refused_with_room, c.refused_calls) for c in fleet]),
        ],
        "of the attempts the fleet refused",
        None,
    )
    bars(
        axes[2],
        [
            ("answered by the dead replica", [float(c.dead_answers or 0) for c in fleet]),
            ("streams cut by the kill", [float(c.streams_cut or 0) for c in fleet]),
            ("lost in the rolling restart", [float(c.lost_in_restart or 0) for c in fleet]),
        ],
        "calls (engine kill, rolling restart)",
        None,
    )
    bars(
        axes[3],
        [
            ("shipped rule", [c.rule_share or 0.0 for c in fleet]),
            ("callers' attempts", [c.callers_refused_share or 0.0 for c in fleet]),
        ],
        "rejected share",
        None,
    )
    fig.suptitle(textwrap.fill(title, 200), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- the scenario ---------------------------------------------------------------------------------


@dataclass
class FleetReport:
    head: str
    table: str
    cells: list[FleetCell]
    shim_flags: list[str]


def missing() -> list[str]:
    """What the scenario needs and this machine lacks (Debian package names)."""
    return [lb for lb in BALANCERS if lb_binary(lb) is None]


def run(duration: float, seed: int) -> FleetReport:
    """The scenario: ``duration`` s of arrivals on the trace of ``seed``."""
    scen = chat_scenario(duration, RATE_FACTOR)
    shape = EngineShape(slots=SLOTS, ttft=0.1, itl=0.02, output_tokens=64)
    flags = shim_flags(shape, scen)
    per_replica = shape.capacity_for(scen.workload)
    calls = arrivals(scen, REPLICAS * per_replica, random.Random(seed))
    thirds = split_trace(calls, REPLICAS, random.Random(seed + 1))
    rule = shipped_rejected_share_rule()
    head = (
        f"fleet: {REPLICAS} simulated engines ({SLOTS} slots, itl {shape.itl:g} s; simulated with any "
        f"--engine: three CPU vLLMs do not fit 2 cores), a shim each, behind nginx and HAProxy as "
        f"shipped; {scen.describe(REPLICAS * per_replica)}; seed {seed}, {len(calls)} calls; faulted "
        f"run: engine {KILLED + 1} killed at {KILL_AT:.0%} of the arrivals for {DEAD_FOR:g} s, then "
        f"each shim restarted in turn; rejected share: Prometheus' {rule or '(no such rule)'}"
    )
    print(f"\n== fleet: {head}\nshim flags: {' '.join(flags)}", flush=True)
    oracle_fleet = schedule(oracle_jobs(calls, shape, scen), REPLICAS * SLOTS).useful_tokens
    oracle_lone = sum(schedule(oracle_jobs(t, shape, scen), SLOTS).useful_tokens for t in thirds)
    cells: list[FleetCell] = []
    for caller in CALLERS:
        lone = lone_cell(caller, drive_lone(caller, scen, thirds, shape, flags), oracle_lone)
        cells.append(lone)
        print(f"  three lone replicas / {caller}: {dataclasses.asdict(lone)}", flush=True)
        for lb in BALANCERS:
            clean = drive_fleet(lb, caller, scen, calls, shape, flags, faulted=False)
            faulted = drive_fleet(lb, caller, scen, calls, shape, flags, faulted=True)
            cell = fleet_cell(lb, caller, clean, faulted, oracle_fleet)
            cells.append(cell)
            print(f"  {BALANCER_LABELS[lb]} / {caller}: {dataclasses.asdict(cell)}", flush=True)
    return FleetReport(head, table(cells), cells, flags)
