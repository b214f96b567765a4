"""Does a fleet behind a load balancer conserve work? Three simulated engines, a shim each,
behind nginx and HAProxy, against one replica alone on each third of the same calls.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_fleet.py --seed 2   # ~7 min
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_fleet.py --quick    # ~3 min

One seeded trace (``real_vllm.mix.chat_scenario``), each arm on fresh servers: **one replica**
(running each random third of the calls in turn, :func:`split_trace`) and **nginx** / **HAProxy**
(:class:`~llm_backoff_shim.lab.fleet.Fleet`); callers plain openai and the SDK's presets. The
figures are pure and tested without load: :func:`conservation`, the EDF oracle (:func:`oracle_jobs`),
:func:`refused_with_room` and :func:`requeued_after_wait` from the shims' JSON access logs.
Writes ``fleet[-quick]-seedN.{png,json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import json
import os
import random
import sys
import textwrap
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from bench_admission_model import Job, job, schedule
from llm_backoff_shim.lab.demo import ProgressLine, shim_flags
from llm_backoff_shim.lab.figures import figures
from llm_backoff_shim.lab.fleet import Fleet
from llm_backoff_shim.lab.fleet_configs import lb_binary
from llm_backoff_shim.lab.load_records import RunResult
from llm_backoff_shim.lab.loadgen import LoadRun, run_load
from llm_backoff_shim.lab.procs import ServerStartError, shim_server, sigterm_as_interrupt, sim_server
from llm_backoff_shim.lab.scenario import Arrival, EngineShape, Scenario, Setup, arrivals
from llm_backoff_shim.serve.observe.access_log import json_records
from real_vllm.measures import QUEUED_REFUSAL
from real_vllm.mix import chat_scenario

# -- the figures (pure: records in, numbers out) ---------------------------------------------

#: Tokens the simulator counts for a prompt of ``w`` words: 1.3 per word plus the chat template's 4.
TOKENS_PER_WORD = 1.3
TEMPLATE_TOKENS = 4


def split_trace(calls: Sequence[Arrival], parts: int, rng: random.Random) -> list[list[Arrival]]:
    """``calls`` dealt at random into ``parts`` traces (each call to one part, equal chances),
    each renumbered from 0 in time order."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    dealt: list[list[Arrival]] = [[] for _ in range(parts)]
    for call in calls:
        dealt[rng.randrange(parts)].append(call)
    return [[replace(call, index=i) for i, call in enumerate(part)] for part in dealt]


def conservation(fleet_useful: float, single_useful: float, replicas: int) -> float | None:
    """Useful tokens of the fleet over ``replicas`` x one replica's; None without a reference."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if single_useful <= 0:
        return None
    return fleet_useful / (replicas * single_useful)


def prompt_tokens(prompt: str | None) -> int:
    """The simulator's token count of a prompt (the load generator's fixed prompt when None)."""
    words = len((prompt or "call 0").split())
    return round(TOKENS_PER_WORD * words + TEMPLATE_TOKENS)


def oracle_jobs(calls: Iterable[Arrival], shape: EngineShape, scenario: Scenario) -> list[Job]:
    """The trace as ``bench_admission_model.schedule`` takes it: each call's answer length, its slot time on
    the simulator (first token ``ttft`` plus its prompt's prefill after the start, then one token per
    ``itl``) and the latest start that is still useful (its class's TTFT budget and deadline)."""
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


# -- the shims' access logs ---------------------------------------------------------------------

#: Outcomes of a request that held one of the shim's slots (it reached the engine).
ADMITTED = frozenset({"completed", "client_disconnected", "upstream_error"})


@dataclass(frozen=True)
class Visit:
    """One request as one shim logged it: arrival and end (wall-clock seconds), when it took a
    slot (None: it never did), its outcome, rejection code and hint, and the caller's request id."""

    replica: int
    arrival: float
    end: float
    admitted_at: float | None
    outcome: str
    code: str | None
    retry_after: float | None
    request_id: str | None


def _wall(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _seconds(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) / 1000.0 if isinstance(value, (int, float)) else None


def visits(replica: int, records: Iterable[dict[str, Any]]) -> list[Visit]:
    """The generation requests of one shim's parsed JSON access records (others are skipped)."""
    found = []
    for r in records:
        total, path = _seconds(r, "total_ms"), str(r.get("path", ""))
        if not isinstance(r.get("time"), str) or total is None or not path.startswith("/v1/"):
            continue
        end = _wall(r["time"])
        arrival = end - total
        outcome = str(r.get("outcome"))
        admitted = arrival + (_seconds(r, "queue_ms") or 0.0) if outcome in ADMITTED else None
        hint = float(h) if isinstance(h := r.get("retry_after_s"), (int, float)) else None
        found.append(
            Visit(replica, arrival, end, admitted, outcome, r.get("code"), hint, r.get("request_id"))
        )
    return found


class Occupancy:
    """Requests holding a slot of each replica over time, from its admitted visits."""

    def __init__(self, all_visits: Iterable[Visit], replicas: int) -> None:
        self._starts: list[list[float]] = [[] for _ in range(replicas)]
        self._ends: list[list[float]] = [[] for _ in range(replicas)]
        for v in all_visits:
            if v.admitted_at is not None:
                self._starts[v.replica].append(v.admitted_at)
                self._ends[v.replica].append(v.end)
        for lst in (*self._starts, *self._ends):
            lst.sort()

    def at(self, replica: int, t: float) -> int:
        """Requests holding a slot of ``replica`` at ``t`` (taken at or before, not yet ended)."""
        return bisect.bisect_right(self._starts[replica], t) - bisect.bisect_right(self._ends[replica], t)


def _by_request(all_visits: Iterable[Visit]) -> dict[str, list[Visit]]:
    by_id: dict[str, list[Visit]] = {}
    for v in all_visits:
        if v.request_id:
            by_id.setdefault(v.request_id, []).append(v)
    return by_id


@dataclass(frozen=True)
class RefusalsWithRoom:
    """Calls the fleet refused (every replica tried refused them), and how many of those were
    refused while some replica had a free slot; ``tries`` how many replicas such a call visited."""

    refused: int
    with_room: int
    tries: dict[int, int]

    @property
    def share(self) -> float | None:
        return self.with_room / self.refused if self.refused else None


def refused_with_room(
    all_visits: Sequence[Visit], replicas: int, slots: int, *, margin: float = 0.005
) -> RefusalsWithRoom:
    """Among the request ids whose every visit was refused, those for which some replica had fewer
    than ``slots`` requests holding a slot from ``margin`` s before the last refusal's answer to
    ``margin`` s after (free for that whole span). Visits without a request id are left out."""
    occupancy = Occupancy(all_visits, replicas)
    by_id = _by_request(all_visits)
    refused = with_room = 0
    tries: dict[int, int] = {}
    for group in by_id.values():
        if any(v.outcome != "rejected" for v in group):
            continue
        refused += 1
        tries[len(group)] = tries.get(len(group), 0) + 1
        t = max(v.end for v in group)
        if any(
            max(occupancy.at(r, t - margin), occupancy.at(r, t), occupancy.at(r, t + margin)) < slots
            for r in range(replicas)
        ):
            with_room += 1
    return RefusalsWithRoom(refused, with_room, dict(sorted(tries.items())))


@dataclass(frozen=True)
class Requeued:
    """Load-balancer attempts sent on to another replica after a replica had queued them and
    then refused them (a wait of more than :data:`QUEUED_REFUSAL` s): how many, how many of
    those were then served, and each one's time in the fleet (first arrival to last answer)."""

    count: int
    served: int
    spans: list[float]


def requeued_after_wait(all_visits: Sequence[Visit]) -> Requeued:
    """Among the request ids visiting several replicas, those whose visit before the last was a
    refusal after a queue wait (the load balancer tried again after the shim's wait ran out)."""
    by_id = _by_request(all_visits)
    count = served = 0
    spans = []
    for group in by_id.values():
        group.sort(key=lambda v: v.arrival)
        waited = [v for v in group[:-1] if v.outcome == "rejected" and v.end - v.arrival > QUEUED_REFUSAL]
        if not waited:
            continue
        count += 1
        served += group[-1].outcome != "rejected"
        spans.append(group[-1].end - group[0].arrival)
    return Requeued(count, served, sorted(spans))


# -- the run ----------------------------------------------------------------------------------

REPLICAS = 3
SLOTS = 8
#: The shims' access logs, for the refusals a replica with room could have taken.
LOG_FLAGS = ("--log-level", "info", "--log-format", "json")


ARMS = {
    "plain": Setup("plain openai", "shim", "plain"),
    "presets": Setup("llm_backoff presets", "shim", "llm_backoff_presets"),
}
TARGET_LABELS = {"single": "one replica", "nginx": "nginx fleet", "haproxy": "HAProxy fleet"}
TARGETS = tuple(TARGET_LABELS)


@dataclass
class Cell:
    """One arm on one target: the headline figures, as numbers (None: not applicable)."""

    target: str
    arm: str
    seed: int
    calls: int
    interactive_calls: int
    interactive_within_budget: int
    batch_calls: int
    batch_ok: int
    useful_tokens: int
    ceiling: float
    oracle_useful: int
    refusal_p50: float | None
    refusal_p99: float | None
    wasted_share: float
    refused_calls: int
    refused_with_room: int
    #: Load-balancer attempts a replica queued, then refused, that went on to another replica,
    #: and how many of those were served there.
    requeued: int
    requeued_served: int
    load: float
    elapsed: float
    #: Replicas whose work the cell counts: the fleet's, or the thirds one replica ran in turn.
    replicas: int = 1

    @property
    def useful_fraction(self) -> float:
        return self.useful_tokens / self.ceiling if self.ceiling else 0.0


@dataclass
class Driven:
    """One load run on fresh servers: the records, the shims' access logs, the machine's load."""

    result: RunResult
    logs: list[str]
    load: float


def drive(
    target: str, arm: Setup, scen: Scenario, calls: Sequence[Arrival], shape: EngineShape, flags: list[str]
) -> Driven:
    replicas = 1 if target == "single" else REPLICAS
    logged = [*flags, *LOG_FLAGS]
    with contextlib.ExitStack() as stack:
        if target == "single":
            sim = stack.enter_context(sim_server(shape.sim_flags()))
            shim = stack.enter_context(shim_server(sim, logged))
            url, engines, shims = shim.url, [sim.url], [shim.url]
            logs = [lambda: shim.log_tail(50_000_000)]
        else:
            fleet = stack.enter_context(
                Fleet(replicas, target, sim_flags=shape.sim_flags(), shim_flags=logged)
            )
            url, engines, shims = fleet.url, fleet.engine_urls, fleet.shim_urls
            logs = [(lambda i=i: fleet.shim_log(i, 50_000_000)) for i in range(replicas)]
        load = os.getloadavg()[0]
        label = f"{TARGET_LABELS[target]} / {arm.label}"
        print(f"- {label}: {len(calls)} calls (machine load {load:.1f})", flush=True)
        line = ProgressLine(sys.stderr, label)
        run = LoadRun(
            arm,
            scen,
            calls,
            target_url=url,
            engine_url=engines[0],
            engine_urls=engines,
            shim_urls=shims,
            capacity=replicas * shape.capacity_for(scen.workload),
            progress=line,
            start_deadline=False,
            token_capacity=replicas * shape.token_capacity_for(scen.workload),
        )
        result = run_load(run)
        line.done()
        texts = [read() for read in logs]
    return Driven(result, texts, load)


def side_by_side(runs: Sequence[Driven]) -> RunResult:
    """Runs of separate replicas on parts of one trace, as one result: their calls together, their
    engines' counts summed (no samples: the parts ran one after another)."""
    first = runs[0].result
    engines = [r.result.engine_stats for r in runs]
    stats: dict[str, Any] = {
        key: sum(int(e.get(key, 0)) for e in engines) for key in ("tokens_generated", "aborted_tokens")
    }
    stats["engines"] = engines
    calls, elapsed = [c for r in runs for c in r.result.calls], max(r.result.elapsed for r in runs)
    capacity, tokens = sum(r.result.capacity for r in runs), sum(r.result.token_capacity or 0.0 for r in runs)
    return RunResult(first.setup, first.scenario, capacity, calls, [], stats, elapsed, tokens)


def run_cell(
    target: str,
    arm: str,
    scen: Scenario,
    traces: Sequence[Sequence[Arrival]],
    shape: EngineShape,
    flags: list[str],
    seed: int,
) -> tuple[RunResult, Cell]:
    """``traces``: the fleet's trace; for one replica, each part of it it runs alone, in turn."""
    replicas = 1 if target == "single" else REPLICAS
    runs = [drive(target, ARMS[arm], scen, calls, shape, flags) for calls in traces]
    result = runs[0].result if len(runs) == 1 else side_by_side(runs)
    figs = figures(result)
    seen = [[v for i, text in enumerate(run.logs) for v in visits(i, json_records(text))] for run in runs]
    rooms = [refused_with_room(visited, replicas, shape.slots) for visited in seen]
    again = [requeued_after_wait(visited) for visited in seen]
    slots = replicas * shape.slots
    oracle = sum(schedule(oracle_jobs(calls, shape, scen), slots).useful_tokens for calls in traces)
    cell = Cell(
        target=target,
        arm=arm,
        seed=seed,
        calls=figs.calls,
        interactive_calls=figs.interactive_calls,
        interactive_within_budget=figs.interactive_within_budget,
        batch_calls=figs.batch_calls,
        batch_ok=figs.batch_ok,
        useful_tokens=figs.useful_tokens,
        ceiling=figs.useful_ceiling or 0.0,
        oracle_useful=oracle,
        refusal_p50=figs.rejection_p50,
        refusal_p99=figs.rejection_p99,
        wasted_share=figs.wasted_fraction,
        refused_calls=sum(r.refused for r in rooms),
        refused_with_room=sum(r.with_room for r in rooms),
        requeued=sum(a.count for a in again),
        requeued_served=sum(a.served for a in again),
        load=max(r.load for r in runs),
        elapsed=result.elapsed,
        replicas=replicas if target != "single" else len(traces),
    )
    print("  " + cell_line(cell), flush=True)
    return result, cell


# -- reporting -----------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}" if value >= 0.1 or value == 0 else f"{value:.1%}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def cell_line(c: Cell) -> str:
    return (
        f"useful {c.useful_tokens} tokens ({_pct(c.useful_fraction)} of the ceiling, oracle "
        f"{_pct(c.oracle_useful / c.ceiling if c.ceiling else None)}), interactive "
        f"{c.interactive_within_budget}/{c.interactive_calls} within budget, batch "
        f"{c.batch_ok}/{c.batch_calls}, refusal p50/p99 {_s(c.refusal_p50)}/{_s(c.refusal_p99)}, "
        f"wasted {_pct(c.wasted_share)}, {c.refused_with_room}/{c.refused_calls} refused with a replica "
        f"free, {c.requeued} sent on after a queue wait ({c.requeued_served} then served); "
        f"{c.elapsed:.0f} s"
    )


def find(cells: Sequence[Cell], target: str, arm: str) -> Cell | None:
    return next((c for c in cells if c.target == target and c.arm == arm), None)


def ratio_rows(cells: Sequence[Cell], arms: Sequence[str], targets: Sequence[str]) -> list[list[str]]:
    rows = []
    for arm in arms:
        single = find(cells, "single", arm)
        for target in targets:
            c = find(cells, target, arm)
            if c is None:
                continue
            conserved = oracle_conserved = None
            if single is not None and target != "single":
                conserved = conservation(c.useful_tokens, single.useful_tokens / single.replicas, REPLICAS)
                oracle_one = single.oracle_useful / single.replicas
                oracle_conserved = conservation(c.oracle_useful, oracle_one, REPLICAS)
            plain = find(cells, target, "plain")
            vs_plain = None
            if plain is not None and arm != "plain" and plain.useful_tokens:
                vs_plain = c.useful_tokens / plain.useful_tokens
            rows.append(
                [
                    TARGET_LABELS[target],
                    ARMS[arm].label,
                    f"{c.useful_tokens / 1000:.1f}k ({_pct(c.useful_fraction)})",
                    "-" if conserved is None else f"{conserved:.3f} (oracle {_ratio(oracle_conserved)})",
                    "-" if vs_plain is None else f"{vs_plain:.2f}",
                    f"{c.interactive_within_budget}/{c.interactive_calls}",
                    f"{c.batch_ok}/{c.batch_calls}",
                    f"{_s(c.refusal_p50)} / {_s(c.refusal_p99)}",
                    f"{c.refused_with_room}/{c.refused_calls}",
                    f"{c.requeued} ({c.requeued_served})",
                    _pct(c.wasted_share),
                ]
            )
    return rows


HEADER = [
    "target",
    "callers",
    "useful tokens (of ceiling)",
    "fleet / 3x one replica",
    "vs plain openai",
    "interactive within 5 s",
    "batch served",
    "refusal p50 / p99",
    "refused with a replica free",
    "sent on after a queue wait (then served)",
    "engine tokens wasted",
]


def markdown(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def save_plot(
    cells: Sequence[Cell], timeline: Sequence[tuple[str, RunResult]], path: Path, title: str
) -> Path:
    from llm_backoff_shim.lab.extra import require_plotting

    require_plotting(f"the plot {path.name}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(c.arm for c in cells))
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.6))
    colours = {"single": "tab:grey", "nginx": "tab:green", "haproxy": "tab:blue"}
    panels = (
        ("useful tokens per replica", lambda c: c.useful_tokens / c.replicas),
        (
            "calls within budget per replica",
            lambda c: (c.interactive_within_budget + c.batch_ok) / c.replicas,
        ),
        ("refusal p99 (s)", lambda c: c.refusal_p99 or 0.0),
        ("engine tokens wasted", lambda c: c.wasted_share),
    )
    width = 0.8 / len(TARGETS)
    for ax, (name, value) in zip(axes.flat, panels, strict=False):
        for j, target in enumerate(TARGETS):
            xs, ys = [], []
            for i, arm in enumerate(arms):
                c = find(cells, target, arm)
                if c is not None:
                    xs.append(i + (j - 1) * width)
                    ys.append(value(c))
            ax.bar(xs, ys, width, color=colours[target], label=TARGET_LABELS[target])
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels([ARMS[a].label for a in arms], fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    busy = axes.flat[4]
    for label, result in timeline:
        samples = [s for s in result.samples if s.replicas]
        for r in range(REPLICAS):
            running = [s.replicas[r][0] or 0 for s in samples]
            busy.plot([s.t for s in samples], running, linewidth=0.8, label=f"{label}, engine {r + 1}")
    busy.set_title("requests running in each engine (presets)", fontsize=10)
    busy.set_xlabel("s")
    busy.legend(fontsize=6)
    fig.suptitle(textwrap.fill(title, 190), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--quick", action="store_true", help="8 s of arrivals instead of 20")
    add("--seed", type=int, default=1)
    add("--duration", type=float, help="seconds of arrivals (default 20, 8 with --quick)")
    add("--rate-factor", type=float, default=2.0, help="arrival rate / the fleet's capacity")
    add("--itl", type=float, default=0.02, help="the simulator's seconds per token per sequence")
    add("--setups", default="plain,presets", help=f"comma-separated, of {', '.join(ARMS)}")
    add("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    add("--out", type=Path, default=Path("docs/img"), help="folder for the PNG, JSON and Markdown")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    arms = args.setups.split(",")
    targets = args.targets.split(",")
    unknown = (set(arms) - set(ARMS)) | (set(targets) - set(TARGETS))
    if unknown:
        print(f"bench_fleet: unknown {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    for lb in targets:
        if lb != "single" and lb_binary(lb) is None:
            print(f"bench_fleet: {lb} is not installed (apt-get install {lb})", file=sys.stderr)
            return 2
    duration = args.duration or (8.0 if args.quick else 20.0)
    base = chat_scenario(duration, args.rate_factor)
    shape = EngineShape(slots=SLOTS, ttft=0.1, itl=args.itl, output_tokens=64)
    flags = shim_flags(shape, base)
    per_replica = shape.capacity_for(base.workload)
    fleet_calls = arrivals(base, REPLICAS * per_replica, random.Random(args.seed))
    thirds = split_trace(fleet_calls, REPLICAS, random.Random(args.seed + 1))
    print(
        f"engine: simulator, {SLOTS} slots, ttft {shape.ttft:g} s, itl {shape.itl:g} s "
        f"({shape.token_capacity_for(base.workload):.0f} answer tokens/s, {per_replica:.2f} calls/s each)\n"
        f"fleet load: {base.describe(REPLICAS * per_replica)}\n"
        f"{len(fleet_calls)} calls to the fleet; one replica alone runs {len(thirds)} random third(s) "
        f"of them in turn ({', '.join(str(len(t)) for t in thirds)} calls); "
        f"shim flags: {' '.join(flags)}",
        flush=True,
    )
    cells: list[Cell] = []
    timeline: list[tuple[str, RunResult]] = []
    started = time.monotonic()
    try:
        with sigterm_as_interrupt():
            for arm in arms:
                for target in targets:
                    traces = thirds if target == "single" else [fleet_calls]
                    result, cell = run_cell(target, arm, base, traces, shape, flags, args.seed)
                    cells.append(cell)
                    if target != "single" and arm == arms[-1]:
                        timeline.append((TARGET_LABELS[target], result))
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130
    except ServerStartError as exc:
        print(f"bench_fleet: {exc}", file=sys.stderr)
        return 1
    rows = ratio_rows(cells, arms, targets)
    head = (
        f"{REPLICAS} simulated engines ({SLOTS} slots, itl {shape.itl:g} s), a shim each; "
        f"{base.describe(REPLICAS * per_replica)}; seed {args.seed}; {len(fleet_calls)} calls "
        f"(one replica: {sum(len(t) for t in thirds)})"
    )
    print("\n" + head + "\n\n" + markdown(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"fleet{'-quick' if args.quick else ''}-seed{args.seed}"
    png = save_plot(cells, timeline, args.out / f"{stem}.png", head)
    record = {"head": head, "shim_flags": flags, "cells": [dataclasses.asdict(c) for c in cells]}
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(head + "\n\n" + markdown(rows) + "\n")
    print(f"\nplot: {png}\nMarkdown: {args.out / f'{stem}.md'}\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
