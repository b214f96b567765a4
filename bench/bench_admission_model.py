"""The admission model in virtual time: the shim's real admission decisions, no sockets, no sleeping.

    .venv/bin/python bench/bench_admission_model.py                    # --mode overload, 30 seeds
    .venv/bin/python bench/bench_admission_model.py --mode oracle      # against the EDF oracle
    .venv/bin/python bench/bench_admission_model.py --mode mix         # the scoreboard's mix trace

``--mode overload`` (:mod:`llm_backoff_shim.lab.overload_model`): the overload scenarios (a
burst of 200, 2x and 1.2x the engine for 30 s, and the demo's load) against callers making
llm_backoff's retry decisions, on an engine that takes exactly its service time (with
``--lengths``, each call's own), about 0.1 s per run. A real run's success count moves by 2-3
between runs of the same code; this shows a change to admission over 20-100 seeds in seconds.
Per scenario, over the seeds: calls served within the deadline (and the fewest in one run),
interactive calls served, attempts per call, first retries admitted, the largest retry wave
(100 ms), the worst interactive TTFT p99, idle slot-seconds before the last completion, the
refusals that came after a wait in the queue, the slot-time idle while a caller that could
still have been served waited, and useful tokens over the capacity bound (medians). A
before/after: run it again with the other tree's sources first on ``PYTHONPATH``.

``--mode oracle``: an upper bound on useful tokens, from a scheduler that knows every
request's service time in advance (:func:`schedule`), beside what the shim and its callers
achieve (plain-openai-like callers, the SDK's presets, stated budgets) on the model of the
real-vLLM comparison (8 slots, 50 ms TTFT, 8 ms per token, answers lognormal median 64, 70 %
interactive with a 5 s TTFT budget, 20 s deadline). The oracle plays the trace on the model's
engine (``slots`` slots; a request generating ``n`` tokens holds one for ``ttft + (n - 1) *
itl``): whenever a slot is free it starts, of the requests that have arrived and can still be
served usefully (first token within its budget, end within its deadline), the one whose latest
useful start is soonest, and drops a request whose latest start has passed. With
``classes_first=("interactive",)`` it serves interactive before any batch (EDF within a class):
the most interactive calls any scheduler could serve within budget, and what is then left for
batch. Greedy EDF is not optimal under overload, but it never idles a slot while a servable
request waits and never serves one uselessly. Pure: no clock, no I/O.

``--mode mix``: the scoreboard's ``mix`` trace (``real_vllm.mix.mix_trace``: 80 % chat with a
5 s TTFT budget, 20 % prompts of 1.5-3k tokens, batch; ``--scenario chat``: 30 % batch of chat's
lengths) at ``--rate-factor`` times the fitted
engine model's capacity, through the shim's admission decisions with ``--flags`` (calibrate's on
the real vLLM; :mod:`llm_backoff_shim.lab.mix_model`, one attempt per call) in front of the
simulator's engine model with ``scoreboard.FITTED_ENGINE_FLAGS``. Per seed: chat within budget
and useful tokens against the oracle's (``real_vllm.mix.oracle``), every refusal's class, code and
reason (numbers stripped), the queue-wait estimates against the waits, and the slot-time the
engine left idle while requests were queued in the shim (``--detail``: by the shim's state).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import json
import random
import re
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llm_backoff_shim.lab.overload_model as overload_model
from llm_backoff import RetryPolicy
from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.tickets import Outcome, Rejection
from llm_backoff_shim.lab.demo import shim_flags
from llm_backoff_shim.lab.mix_model import MixArrival, MixModel
from llm_backoff_shim.lab.overload_model import OutputLengths, OverloadModel, service_of
from llm_backoff_shim.lab.overload_results import ModelResult
from llm_backoff_shim.lab.scenario import EngineShape, RequestClass, Scenario, demo_scenario
from llm_backoff_shim.lab.workload import CHAT_AND_LONG, prompt_text
from llm_backoff_shim.serve.app import build_controller
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.sim.server import config_from_args, parse_args
from llm_backoff_shim.testing import ManualClock

# -- the oracle ---------------------------------------------------------------------------------

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

    # The model looks the policy up in its own namespace on every call.
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


# -- --mode overload ----------------------------------------------------------------------------


def scenarios() -> list[Scenario]:
    """A burst of 200 judged by success within a 30 s deadline (with a 10 s budget to begin, 140
    interactive callers at once cannot all start: the engine starts ~67 in 10 s, so the burst's
    callers state no start deadline), and 2x and 1.2x the engine's capacity for 30 s."""
    return [
        Scenario(
            "burst", burst=200, rate_factor=0, duration=0, deadline=30, ttft_budget=10, start_deadline=False
        ),
        Scenario("poisson-2x", burst=0, rate_factor=2.0, duration=30, deadline=30, ttft_budget=10),
        Scenario("poisson-1.2x", burst=0, rate_factor=1.2, duration=30, deadline=30, ttft_budget=10),
    ]


def varied_scenarios(shape: EngineShape, lengths: OutputLengths) -> list[tuple[Scenario, list[str]]]:
    """A load like the real-engine comparison's: 2x capacity for 30 s, 70 % interactive callers
    that must begin within 5 s, a 20 s deadline per call; once behind the demo's sizing (a
    queue of two batches, nobody waits longer than the TTFT budget), once behind a sizing like
    ``calibrate``'s on that engine (5 queue places, a queue wait of one mean service time)."""
    scenario = Scenario("varied-2x", burst=0, rate_factor=2.0, duration=30, deadline=20, ttft_budget=5)
    mean = f"{service_of(shape, 1) + (lengths.mean() - 1) * shape.itl:.2f}"
    calibrated = ["--max-concurrency", str(shape.slots), "--max-queue", "5"]
    calibrated += ["--max-queue-wait", mean, "--initial-service-time", mean]
    small = dataclasses.replace(scenario, name="varied-2x-small-queue")
    return [(scenario, shim_flags(shape, scenario, hold_batch=False)), (small, calibrated)]


OVERLOAD_HEADER = (
    "scenario | served within deadline | fewest in a run | interactive served | attempts per call | "
    "first retry admitted | largest retry wave | worst interactive TTFT p99 | idle slot-s per run | "
    "refusals after a wait | idle while a caller could be served (median) | useful / capacity (median)"
)


def summarize(scenario: Scenario, results: Sequence[ModelResult]) -> list[str]:
    calls = sum(len(r.calls) for r in results)
    ok = sum(r.successes for r in results)
    interactive = sum(sum(c.ok for c in r.calls if c.arrival.cls == "interactive") for r in results)
    admitted = sum(r.first_retry_admitted[0] for r in results)
    retried = sum(r.first_retry_admitted[1] for r in results)
    p99s = [p for r in results if (p := r.ttft_p99()) is not None]
    idle = [r.idle_while_servable_share for r in results]
    return [
        scenario.name + ("" if scenario.start_deadline else " (no start deadline)"),
        f"{ok}/{calls} = {ok / calls:.1%}",
        str(min(r.successes for r in results)),
        str(interactive),
        f"{sum(r.attempts for r in results) / calls:.2f}",
        f"{admitted / retried:.1%}" if retried else "-",
        str(max(r.largest_retry_wave for r in results)),
        f"{max(p99s):.2f} s" if p99s else "-",
        f"{sum(r.idle_slot_seconds for r in results) / len(results):.1f}",
        f"{sum(len(r.refused_after_a_wait) for r in results)} of "
        f"{sum(len(c.refusal_times) for r in results for c in r.calls)}",
        f"{statistics.median(idle):.1%} (max {max(idle):.1%})",
        f"{statistics.median(r.useful_share for r in results):.2f}",
    ]


def run_overload(args: argparse.Namespace, seeds: list[int]) -> None:
    lengths = None
    if args.lengths:
        median, sigma, cap = args.lengths.split(",")
        lengths = OutputLengths(float(median), float(sigma), int(cap))
    shape = EngineShape()
    chosen = [(s, shim_flags(shape, s, hold_batch=False)) for s in [*scenarios(), demo_scenario(quick=False)]]
    if lengths is not None:
        chosen += varied_scenarios(shape, lengths)
    if args.start_deadline_everywhere:
        chosen = [(dataclasses.replace(s, start_deadline=True), f) for s, f in chosen]
    if args.only:
        chosen = [(s, f) for s, f in chosen if s.name in set(args.only.split(","))]
    rows, runs = [], {}
    started = time.monotonic()
    for scenario, sizing in chosen:
        results = []
        for seed in seeds:
            model = OverloadModel(
                scenario,
                shape,
                [*sizing, *args.shim_flag],
                seed=seed,
                service_jitter=args.service_jitter,
                lengths=lengths,
            )
            results.append(model.run())
            print(f"\r{scenario.name}: seed {seed}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        rows.append(summarize(scenario, results))
        runs[scenario.name] = {
            "idle_while_servable": [r.idle_while_servable_share for r in results],
            "useful": [r.useful_share for r in results],
            "served": [r.successes / len(r.calls) for r in results],
        }
    print(f"{len(seeds)} seeds per scenario, {time.monotonic() - started:.1f} s\n")
    print(f"| {OVERLOAD_HEADER} |")
    print("|---|" + "---:|" * OVERLOAD_HEADER.count("|"))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")


# -- --mode oracle ------------------------------------------------------------------------------


def run_oracle(args: argparse.Namespace, seeds: list[int]) -> None:
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
            for seed in seeds:
                flags = shlex.split(args.flags)
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


# -- --mode mix ---------------------------------------------------------------------------------

#: calibrate's fresh flags on the real vLLM for the mix: what --mode mix plays by default.
CALIBRATED_MIX = (
    "--max-concurrency 8 --max-queue 143 --max-queue-wait 4.76 --class-max-queue interactive=34,batch=109 "
    "--class-max-queue-wait batch=15 --retry-after-max 5 --max-inflight-tokens 5312"
)


def _reason(message: str) -> str:
    return re.sub(r"[0-9.]+", "N", message)


class DiagModel(MixModel):
    """:class:`MixModel` that keeps every refusal's reason, the queue-wait estimate each queued
    request got at arrival, and the engine's idle slot-time while requests waited in the shim.

    It wraps the controller's methods (and the placement's arrival check) on this instance only;
    the decisions are the shim's own."""

    #: As the scoreboard's callers on the wire: each closes its stream once its answer has its
    #: length, so the shim sees every call end as a client disconnect (ABORTED): it learns no
    #: service time and no answer length, and prices every request on the cold-start prior.
    wire_hangups = False

    def __init__(self, *args: Any, slots: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots = slots
        self.reasons: Counter[str] = Counter()
        self.idle: Counter[str] = Counter()
        self.service_at_refusal: list[float] = []
        self.estimates: dict[int, float] = {}  # ticket id -> estimated wait at arrival
        c = self.controller
        assert c is not None
        submit, recheck = c.submit, c.recheck

        def logged(request: Any) -> Any:
            decision = submit(request)
            if isinstance(decision, Rejection):
                self.service_at_refusal.append(c.estimator.service_time)
                self.reasons[f"{request.cls}:{decision.code}:{_reason(decision.message)}"] += 1
            return decision

        def rechecked() -> Any:
            dispatch = recheck()
            for t in dispatch.expired:
                assert t.rejection is not None
                self.reasons[
                    f"{t.request.cls}:{t.rejection.code}(recheck):{_reason(t.rejection.message)}"
                ] += 1
            return dispatch

        placement = c._placement
        refusal = placement.arrival_refusal

        def estimated(ticket: Any, ahead: Any, in_class: Any) -> Any:
            above = placement._queues.above(ticket.cls)
            promised_by = above if ticket.returning else (*above, ticket.cls)
            if placement._estimator.samples:
                wait = placement._waits.at(ticket.cls, ahead, in_class, promised_by, ticket.places)
                self.estimates[ticket.id] = wait
            return refusal(ticket, ahead, in_class)

        c.submit, c.recheck = logged, rechecked  # type: ignore[method-assign]
        placement.arrival_refusal = estimated  # type: ignore[method-assign]

    def _tokens(self, touched: Any) -> Any:
        if not self.wire_hangups:
            return super()._tokens(touched)
        c = self.controller
        assert c is not None
        release, observe = c.release, c.estimator.observe_first_byte
        c.release = lambda ticket, outcome, answer_tokens=None: release(ticket, Outcome.ABORTED)  # type: ignore[method-assign]
        c.estimator.observe_first_byte = lambda seconds: None  # type: ignore[method-assign]
        try:
            return super()._tokens(touched)
        finally:
            c.release, c.estimator.observe_first_byte = release, observe  # type: ignore[method-assign]

    def _send(self, call: Any) -> None:
        c = self.controller
        if c is not None and call.arrival.part.cls == "batch":
            if self.clock.now < self.duration:
                flood = "while chat queued" if c.queued("interactive") else "no chat queued"
                self.reasons[f"(long admitted {flood}, t<{self.duration:g})"] += 1
            else:
                self.reasons["(long admitted after arrivals)"] += 1
        super()._send(call)

    def _advance(self, when: float) -> None:
        now, c = self.clock.now, self.controller
        if c is not None and when > now:
            free = self.slots - self.engine.num_running
            # During the arrivals and the chat budget after them (chat could still be served),
            # and in the tail after.
            edge = self.duration + 5.0
            for lo, hi, tag in ((now, min(when, edge), "peak"), (max(now, edge), when, "tail")):
                if hi > lo:
                    if free > 0 and c.queued() and c.in_flight() < self.slots:
                        heads = ",".join(
                            f"{h}={c.queued(h)}" for h in ("interactive", "batch") if c.queued(h)
                        )
                        why = f"shim holds {c.in_flight()}, queued {heads}, tokens {c.in_flight_tokens()}"
                        self.idle[f"{tag}:{why}"] += free * (hi - lo)
                    self.idle[f"_slot_time:{tag}"] += self.slots * (hi - lo)
        super()._advance(when)


def run_mix(args: argparse.Namespace, seeds: list[int]) -> None:
    import scoreboard
    from real_vllm.mix import Budgets, Mix, capacity, mix_trace, oracle

    params = config_from_args(parse_args(shlex.split(scoreboard.FITTED_ENGINE_FLAGS))).engine_params()
    if args.scenario == "chat":  # the scoreboard's short chat beside batch of chat's lengths
        mix = Mix(long_share=0.3, tokens_per_word=1.3, long_prompts=False)
        budgets = Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=20.0)
    else:
        mix = Mix(long_share=0.2, tokens_per_word=1.3)
        budgets = Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=30.0)
    rate = args.rate_factor * capacity(params, mix)[0]
    parts = {"chat": CHAT_AND_LONG.part("chat"), "long": CHAT_AND_LONG.part("long")}
    for seed in seeds:
        trace = mix_trace(mix, seed, rate=rate, duration=args.duration)
        rng = random.Random(seed + 1000)
        arrivals = [
            MixArrival(c.at, parts[c.kind], c.prompt_tokens, prompt_text(c.prompt_words, rng), c.max_tokens)
            for c in trace
        ]
        best = oracle(trace, params, budgets)
        model = DiagModel(
            arrivals, params, shlex.split(args.flags), duration=args.duration, slots=scoreboard.SLOTS
        )
        model.wire_hangups = args.wire_hangups
        result = model.run()
        chats, longs = result.by_part.get("chat", []), result.by_part.get("long", [])
        slot_time = {tag: model.idle.pop(f"_slot_time:{tag}", 0.0) for tag in ("peak", "tail")}
        idle = {tag: sum(v for k, v in model.idle.items() if k.startswith(tag)) for tag in slot_time}
        chat_ok, long_ok = sum(c.useful for c in chats), sum(c.useful for c in longs)
        o_chat, o_long = best.served.get("chat", 0), best.served.get("long", 0)
        print(
            f"seed {seed}: {rate:.2f} calls/s; chat within budget {chat_ok}/{len(chats)} (oracle {o_chat}, "
            f"{chat_ok / max(1, o_chat):.2f}), useful {result.useful_tokens} (oracle {best.useful_tokens}), "
            f"long served {long_ok}/{len(longs)} (oracle {o_long}); slots idle while the shim queued: "
            f"{idle['peak'] / max(1e-9, slot_time['peak']):.0%} of the slot-time until 5 s after the "
            f"arrivals, {idle['tail'] / max(1e-9, slot_time['tail']):.0%} after"
        )
        for part, mine in (("chat", chats), ("long", longs)):
            outcomes = Counter(
                c.outcome
                + ("/engine" if c.at_engine else "")
                + ("/useful" if c.useful else "")
                + (":" + c.code if c.code else "")
                for c in mine
            )
            print(f"  {part}: {dict(outcomes)}; wasted tokens {sum(c.wasted for c in mine)}")
            pairs = [
                (model.estimates[c.ticket.id], c.ticket.admitted_at - c.ticket.arrived)
                for c in mine
                if c.ticket is not None
                and c.ticket.admitted_at is not None
                and c.ticket.id in model.estimates
            ]
            if pairs:
                print(
                    f"  {part} queued then admitted: {len(pairs)}, estimated wait at arrival mean "
                    f"{statistics.mean(p[0] for p in pairs):.2f} s, actual mean "
                    f"{statistics.mean(p[1] for p in pairs):.2f} s"
                )
        if model.service_at_refusal:
            median = statistics.median(model.service_at_refusal)
            print(f"  the estimator's service time at refusals, median {median:.2f} s")
        for why, n in model.reasons.most_common(8):
            print(f"  {n:4d} {why}")
        if args.detail:
            for why, v in model.idle.most_common(12):
                print(f"  idle {v:6.2f} slot-s  {why}")


# -- main ---------------------------------------------------------------------------------------

MODES: dict[str, tuple[Callable[[argparse.Namespace, list[int]], None], dict[str, Any]]] = {
    "overload": (run_overload, {"seeds": "30", "service_jitter": 0.0}),
    "oracle": (
        run_oracle,
        {
            "seeds": "5",
            "service_jitter": 0.3,
            "rate_factor": 2.0,
            "flags": "--max-concurrency 8 --max-queue 24 --max-queue-wait 1.93",
        },
    ),
    "mix": (run_mix, {"seeds": "11,12", "rate_factor": 3.0, "flags": CALIBRATED_MIX}),
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="overload")
    p.add_argument("--seeds", help="a count N (seeds 1..N) or a comma-separated list (default: per mode)")
    p.add_argument("--flags", help="oracle, mix: the shim's flags (default: calibrate's on the real vLLM)")
    p.add_argument("--rate-factor", type=float, help="oracle, mix: arrivals over the engine's capacity")
    p.add_argument("--service-jitter", type=float, help="overload, oracle: service time x U(1 - j, 1 + j)")
    p.add_argument("--only", default="", help="overload: comma-separated scenario names (default: all)")
    p.add_argument(
        "--start-deadline-everywhere",
        action="store_true",
        help="overload: interactive callers state their TTFT budget in the burst too",
    )
    p.add_argument("--shim-flag", action="append", default=[], help="overload: an extra shim flag (repeat)")
    p.add_argument(
        "--lengths",
        default="",
        metavar="MEDIAN,SIGMA,CAP",
        help="overload: output tokens per call from a lognormal (e.g. 20,0.8,160), asked as max_tokens "
        "with ignore_eos; adds the varied-2x scenarios (default: every call the shape's 20 tokens)",
    )
    p.add_argument("--json", type=Path, help="overload: write each scenario's per-seed measures here")
    p.add_argument("--durations", default="10,30", help="oracle: seconds of arrivals, comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="mix: seconds of arrivals")
    p.add_argument(
        "--wire-hangups",
        action="store_true",
        help="mix: callers close their stream at their answer's length (as on the wire): the shim learns "
        "no service time and no answer length",
    )
    p.add_argument(
        "--scenario", choices=("mix", "chat"), default="mix", help="mix: 'chat' is short chat beside batch"
    )
    p.add_argument("--detail", action="store_true", help="mix: idle slot-time by the shim's state")
    args = p.parse_args(argv)
    run, defaults = MODES[args.mode]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.service_jitter is not None and not 0 <= args.service_jitter < 1:
        p.error("--service-jitter must be in [0, 1)")
    seeds = (
        [int(s) for s in args.seeds.split(",") if s]
        if "," in args.seeds
        else list(range(1, int(args.seeds) + 1))
    )
    run(args, seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
