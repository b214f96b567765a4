"""An upper bound on useful tokens: a scheduler that knows every request's service time in advance.

The issue's capacity figure (the engine's tokens/s with every slot busy, times the arrival
window plus the batch deadline) assumes the engine can be kept busy for that whole span with
work that is still useful. On a given arrival trace it may not: work arrives only during the
window, interactive work must begin within its TTFT budget, and batch work must end within
its deadline, so slots can stand idle at the start and after the last deadline whatever the
scheduler. This module plays the trace through an oracle proxy on the same engine model as
:mod:`llm_backoff_shim.lab.overload_model` (``slots`` slots; a request generating ``n`` tokens
holds one for ``ttft + (n - 1) * itl``):

- every request's service time is known when it arrives (no estimate, no hint, no retry);
- whenever a slot is free, it starts, of the requests that have arrived and can still be
  served usefully (begun in time for its first token within its budget, ended within its
  deadline), the one whose latest useful start is soonest (earliest deadline first on the
  latest start); a request whose latest start has passed is dropped, never started late.

A second oracle (``schedule(..., classes_first=("interactive",))``) serves interactive
requests before any batch one, EDF within each class: the most interactive calls any
scheduler could serve within budget on the trace, and what is then left for batch. The two
bound the trade-off between the comparison's interactive and batch targets.

``main`` prints, for the virtual-time model's version of the real-vLLM comparison, the bound
beside what the shim and its callers achieve (plain-openai-like callers, the SDK's presets,
stated budgets); the real engine's own bound, on its own traces, is ``bench/scoreboard.py``'s oracle:

    cd bench && ../.venv/bin/python oracle_bound.py --seeds 7

Greedy EDF is not optimal under overload (no polynomial scheduler is, for the weighted
problem), but it never idles a slot while a servable request waits and never serves a
request uselessly: what it cannot deliver is, to within the order it picks, work no
scheduler could. Pure: no clock, no I/O.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import random
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import llm_backoff_shim.lab.overload_model as overload_model
from llm_backoff import RetryPolicy
from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.lab.overload_model import OutputLengths, OverloadModel
from llm_backoff_shim.lab.scenario import EngineShape, RequestClass, Scenario
from llm_backoff_shim.serve.app import build_controller
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.testing import ManualClock

#: Interactive callers' policies for the achieved column; batch callers get `RetryPolicy.batch`.
POLICIES: dict[str, Callable[[float, float], RetryPolicy]] = {
    "presets": lambda budget, deadline: RetryPolicy.interactive(start_deadline=budget),
    "budgets": lambda budget, deadline: RetryPolicy(deadline=deadline, start_deadline=budget),
}
#: Like plain openai (both classes): 2 retries, every hint honoured as given, no budget sent
#: (see `plain_controller`), the call's deadline as its timeout.
PLAIN = "plain-like"


def plain_policy(budget: float, deadline: float) -> RetryPolicy:
    return RetryPolicy(deadline=deadline, max_attempts=3, retry_after_jitter=0.0, max_retry_after=60.0)


def plain_controller(flags: Sequence[str]) -> Callable[[ManualClock], AdmissionController]:
    """The shim's controller for ``flags``, whose callers send no ``x-request-timeout-ms`` (as
    plain openai does): every request reaches it with no budget, so none is served as returning."""

    def make(clock: ManualClock) -> AdmissionController:
        controller = build_controller(load_settings(["--upstream", "http://127.0.0.1:9", *flags]), clock)
        submit = controller.submit
        controller.submit = lambda request: submit(dataclasses.replace(request, budget=None))  # type: ignore[method-assign]
        return controller

    return make


@contextlib.contextmanager
def policy_in_model(make: Callable[[float, float], RetryPolicy]) -> Iterator[None]:
    """The overload model's callers use ``make`` (interactive) and the batch preset meanwhile."""

    def policy(cls: RequestClass, scenario: Scenario, *, start_deadline: bool = True) -> RetryPolicy:
        if cls == "interactive" or make is plain_policy:
            return make(scenario.ttft_budget, scenario.deadline_of(cls))
        return RetryPolicy.batch(deadline=scenario.deadline_of(cls))

    # The model looks the policy up in its own namespace per call (bench_interactive_presets too).
    saved = getattr(overload_model, "retry_policy")  # noqa: B009
    setattr(overload_model, "retry_policy", policy)  # noqa: B010
    try:
        yield
    finally:
        setattr(overload_model, "retry_policy", saved)  # noqa: B010


@dataclass(frozen=True)
class Job:
    """One request as the oracle sees it: when it arrived, its tokens and slot time, and the
    latest moment it may start and still be useful."""

    arrived: float
    tokens: int
    service: float
    latest_start: float
    cls: str


@dataclass(frozen=True)
class OracleResult:
    useful_tokens: int
    served: int
    served_by_class: dict[str, int]
    offered_by_class: dict[str, int]
    busy_slot_seconds: float


def job(
    arrived: float,
    tokens: int,
    cls: str,
    *,
    ttft: float,
    itl: float,
    deadline: float,
    ttft_budget: float | None,
) -> Job:
    """A request of ``cls``: useful when it ends within ``deadline`` of its arrival and, with a
    ``ttft_budget``, its first token (``ttft`` after it starts) comes within that budget."""
    service = ttft + (tokens - 1) * itl
    latest = arrived + deadline - service
    if ttft_budget is not None:
        latest = min(latest, arrived + ttft_budget - ttft)
    return Job(arrived, tokens, service, latest, cls)


def schedule(jobs: Sequence[Job], slots: int, *, classes_first: Sequence[str] = ()) -> OracleResult:
    """Greedy EDF on the latest useful start (see the module docstring) over ``slots`` slots.

    ``classes_first``: strict priority instead, these classes in this order before the rest
    (EDF within a class): the most of the first class's calls any scheduler serves usefully,
    and what is left for the others.
    """
    if slots < 1:
        raise ValueError("slots must be >= 1")
    pending = sorted(jobs, key=lambda j: j.arrived)
    rank = {cls: i for i, cls in enumerate(classes_first)}
    free: list[float] = [0.0] * slots  # when each slot is next free (a heap)
    ready: list[tuple[int, float, int, Job]] = []  # (class rank, latest start, order, job)
    offered: dict[str, int] = {}
    served: dict[str, int] = {}
    for j in pending:
        offered[j.cls] = offered.get(j.cls, 0) + 1
    useful = count = 0
    busy = 0.0
    i = 0
    while i < len(pending) or ready:
        t = free[0]
        while i < len(pending) and pending[i].arrived <= t:
            arrived = pending[i]
            heapq.heappush(ready, (rank.get(arrived.cls, len(rank)), arrived.latest_start, i, arrived))
            i += 1
        chosen: Job | None = None
        while ready and chosen is None:
            candidate = heapq.heappop(ready)[3]
            if candidate.latest_start >= t:
                chosen = candidate  # else: can no longer be served usefully, dropped, never started late
        if chosen is None:
            if i >= len(pending):
                break
            heapq.heapreplace(free, max(t, pending[i].arrived))  # idle until the next arrival
            continue
        heapq.heapreplace(free, t + chosen.service)
        useful += chosen.tokens
        count += 1
        busy += chosen.service
        served[chosen.cls] = served.get(chosen.cls, 0) + 1
    return OracleResult(useful, count, served, offered, busy)


# -- the traces: the virtual-time model's and the real-vLLM benchmark's --------------------------


def model_jobs(
    scenario: Scenario, shape: EngineShape, lengths: OutputLengths, seed: int, jitter: float
) -> list[Job]:
    """The trace :class:`~llm_backoff_shim.lab.overload_model.OverloadModel` plays for ``seed``: the
    same arrivals and output lengths (drawn in arrival order from the same seeded sources), each
    service time varied by ``U(1 - jitter, 1 + jitter)`` as the model's engine does."""
    played = OverloadModel(
        scenario, shape, ["--max-concurrency", str(shape.slots)], seed=seed, lengths=lengths
    )
    draw, engine = random.Random(seed + 3), random.Random(seed + 2)
    jobs = []
    for arrival in played.arrivals:
        tokens = lengths.draw(draw)
        spread = 1 + engine.uniform(-jitter, jitter)
        base = job(
            arrival.at,
            tokens,
            arrival.cls,
            ttft=shape.ttft,
            itl=shape.itl,
            deadline=scenario.deadline_of(arrival.cls),
            ttft_budget=scenario.ttft_budget if arrival.cls == "interactive" else None,
        )
        service = base.service * spread
        latest = min(base.arrived + scenario.deadline_of(arrival.cls) - service, base.latest_start)
        jobs.append(Job(base.arrived, tokens, service, latest, base.cls))
    return jobs


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--durations", default="10,30", help="seconds of arrivals, comma-separated")
    p.add_argument("--rate-factor", type=float, default=2.0)
    p.add_argument("--service-jitter", type=float, default=0.3)
    p.add_argument(
        "--shim-flags",
        default="--max-concurrency 8 --max-queue 24 --max-queue-wait 1.93",
        help="the shim's flags for the achieved column (calibrate's on the real vLLM)",
    )
    args = p.parse_args(argv)
    # The real vLLM's shape as the benchmark measured it: 8 slots, ~1000 answer tokens/s
    # together (itl 8 ms per sequence), a first token ~50 ms after admission.
    shape = EngineShape(slots=8, ttft=0.05, itl=0.008, output_tokens=64)
    lengths = OutputLengths(64, 0.8, 512)
    print(
        "| arrivals | policy | oracle useful / capacity | achieved useful / capacity | achieved / oracle | "
        "oracle interactive in budget | achieved interactive in budget | oracle batch served | "
        "achieved batch served | interactive p90 time to failure |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for duration in (float(d) for d in args.durations.split(",")):
        scenario = Scenario(
            "real-vllm-like",
            burst=0,
            rate_factor=args.rate_factor,
            duration=duration,
            deadline=20,
            ttft_budget=5,
            interactive_share=0.7,
            start_deadline=True,
        )
        for name, policy in {PLAIN: plain_policy, **POLICIES}.items():
            bounds, achieved, o_inb, a_inb, o_b, a_b, p90s = [], [], [], [], [], [], []
            for seed in range(1, args.seeds + 1):
                flags = args.shim_flags.split()
                played = OverloadModel(
                    scenario,
                    shape,
                    flags,
                    seed=seed,
                    service_jitter=args.service_jitter,
                    lengths=lengths,
                    controller=plain_controller(flags) if name == PLAIN else None,
                )
                with policy_in_model(policy):
                    result = played.run()
                oracle = schedule(
                    model_jobs(scenario, shape, lengths, seed, args.service_jitter), shape.slots
                )
                bounds.append(oracle.useful_tokens / result.capacity_tokens)
                achieved.append(result.useful_share)
                o_inb.append(oracle.served_by_class.get("interactive", 0))
                a_inb.append(sum(played.useful(c) for c in result.calls if c.arrival.cls == "interactive"))
                batch_calls = [c for c in result.calls if c.arrival.cls == "batch"]
                o_b.append(
                    oracle.served_by_class.get("batch", 0) / max(1, oracle.offered_by_class.get("batch", 0))
                )
                a_b.append(sum(c.ok for c in batch_calls) / max(1, len(batch_calls)))
                failed = sorted(
                    c.end - c.start
                    for c in result.calls
                    if c.arrival.cls == "interactive" and not c.ok and c.end is not None
                )
                p90s.append(failed[int(0.9 * (len(failed) - 1))] if failed else 0.0)
            b, a = statistics.median(bounds), statistics.median(achieved)
            print(
                f"| {duration:g} s at {args.rate_factor:g}x | {name} | {b:.2f} | {a:.2f} | {a / b:.2f} | "
                f"{statistics.median(o_inb):.0f} | {statistics.median(a_inb):.0f} | "
                f"{statistics.median(o_b):.0%} | {statistics.median(a_b):.0%} | "
                f"{statistics.median(p90s):.2f} s |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
