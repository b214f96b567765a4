"""The scoreboard: what a user runs, on a real vLLM, every arm on the same seeded trace.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/scoreboard.py            # ~20 min
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/scoreboard.py --quick    # ~6 min
    .venv/bin/python bench/scoreboard.py --engine sim                                 # no vLLM

What a user does, in order, and so what this does:

1. serves the model with vLLM's own queue bound, as a user would without us: the CPU build
   (``bench/real_vllm/setup.sh`` sets it up when missing) with ``--max-num-seqs 8``,
   ``--max-num-queued-reqs 16`` (running plus waiting: 8 more than the slots) and
   ``--max-num-queued-tokens`` at vLLM's own rule (the chat budget times the engine's prefill
   rate), prefix caching off so no arm is served from a cache the arm before it warmed.
   ``--engine sim`` runs the simulator with the flags fitted to that vLLM instead (the same
   bounds), where vLLM is not installed;
2. runs ``llm-backoff-shim calibrate`` fresh against it, with its defaults and the traffic's
   lengths: once for chat, once with the long-prompt mix;
3. plays each scenario's seeded trace against every arm, a fresh shim with calibrate's
   recommended flags for the arms through the shim. Clients send ``max_tokens: 4096`` or none
   (half each, seeded), as real ones do, and close their stream when the answer has its
   drawn length (``ignore_eos``, so the engine's work is the trace's):

   - ``direct-plain``: plain openai straight at vLLM (its own bound answers 503);
   - ``direct-presets``: ``llm_backoff.wrap(client, request_class=cls)`` straight at vLLM;
   - ``shim-plain``, ``shim-presets``: the same two through the shim;
   - the oracle: earliest deadline first on the engine model fitted to this vLLM, at the speeds
     it showed in this run (:func:`fit_speeds`), knowing every call's service time (``real_vllm.mix.oracle``).

Scenarios (``--scenarios``): ``chat`` (short chat beside batch at 2.5x capacity, 70 %
interactive with a 5 s time-to-first-token budget, 20 s deadline), ``mix`` (80 % chat, 20 %
prompts of 1.5-3k tokens at 3x capacity, long prompts useful within 30 s) and ``burst`` (the
chat traffic at capacity with 6 x slots calls at once a third of the way in); ``tenants`` (one
tenant, its own API key, floods chat at 5x capacity beside three quiet tenants at 0.1x each:
each quiet tenant's chats within budget against its trace played alone, the flooding tenant's
beside all chats within budget (what the engine served in time), Jain's index over the tenants'
chats within budget, each of its max-min fair split); and the peers'
named workloads (``llm_backoff_shim.lab.workloads``), each calibrated on its own lengths:
``shared-prefix`` (inference-perf's, 30 % batch, 2.5x capacity), ``bimodal`` (inference-perf's:
the 1k-token prompts with 512-token answers are the batch class, 3x capacity, useful within 40 s)
and ``batch-gateway`` (the llm-d batch gateway's: its 15/s-then-1/s interactive phases kept as a
shape, 2.5x capacity on average, so 3.3x in the burst half and 0.2x in the trickle half beside
steady batch at 0.75x; its 90 s phases are half of ``--duration`` each; batch useful within 60 s).
``fleet`` (not in the default set: ``--scenarios fleet``) is three simulated replicas behind
nginx and HAProxy as shipped, against three lone replicas, with an engine kill and a rolling
restart under load and the shipped Prometheus rules (``fleet_scenario``); its engines are
simulated whatever ``--engine`` says, on the first seed's trace; it writes ``<name>-fleet.*``.

Judged by what users feel: chat calls served within budget (and of the oracle's), useful
tokens (of the oracle's), batch served, how fast refused interactive calls learned it (p90),
engine work wasted. Writes ``docs/img/scoreboard.{png,json,md}`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import fleet_scenario
from llm_backoff_shim.lab.demo import ProgressLine
from llm_backoff_shim.lab.figures import percentile
from llm_backoff_shim.lab.load_records import CallRecord, RunResult
from llm_backoff_shim.lab.loadgen import LoadRun, run_load
from llm_backoff_shim.lab.procs import (
    ChildServer,
    ServerStartError,
    cli_command,
    shim_server,
    sigterm_as_interrupt,
    sim_server,
)
from llm_backoff_shim.lab.scenario import Arrival, Scenario, Setup
from llm_backoff_shim.lab.workloads import WORKLOADS
from llm_backoff_shim.sim.engine import EngineParams
from llm_backoff_shim.sim.server import config_from_args, parse_args
from real_vllm.capacity import full_load_tokens_per_s
from real_vllm.engine import DEFAULT_ENV, DEFAULT_MODEL, ensure_setup, ready, vllm_server
from real_vllm.measures import engine_pace, idle_slot_share, interactive_failure_paths
from real_vllm.mix import Budgets, Mix, MixCall, MixWorkload, capacity, mix_trace, oracle

LOAD_CPU = 0
ENGINE_CPU = 1
SLOTS = 8
MAX_MODEL_LEN = 4096
#: vLLM's own bound as a user would set it: the slots and as many again waiting.
QUEUED_REQS = 2 * SLOTS
#: What clients send as ``max_tokens`` (None: nothing), drawn per call.
SENT_MAX_TOKENS: tuple[int | None, ...] = (4096, None)
#: The simulator's flags fitted to the CPU vLLM (docs/real-vllm.md: its prefill and decode costs
#: probed alone, then admit and attention times fitted to closed-loop capacities).
FITTED_ENGINE_FLAGS = (
    "--max-num-seqs 8 --ttft 0.018 --itl 0.0056 --itl-batch-factor 0.01 --prefill-time-per-token 0.000025 "
    "--prefill-attention-time 0.000085 --admit-time 0.06 --decode-attention-time 0.0005 "
    "--max-num-batched-tokens 2048 --kv-cache-tokens 131072"
)


@dataclass(frozen=True)
class ScenarioSpec:
    name: str
    title: str
    mix: Mix
    rate_factor: float
    budgets: Budgets
    burst: int = 0
    calibration: str = "chat"
    #: Quiet tenants' rates (x capacity) beside one flooding at ``rate_factor``; () for one caller.
    quiet: tuple[float, ...] = ()


SCENARIOS = {
    "chat": ScenarioSpec(
        "chat",
        "short chat beside batch, 2.5x capacity",
        Mix(long_share=0.3, long_prompts=False),
        2.5,
        Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=20.0),
    ),
    "mix": ScenarioSpec(
        "mix",
        "chat beside long prompts, 3x capacity",
        Mix(long_share=0.2),
        3.0,
        Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=30.0),
        calibration="mix",
    ),
    "burst": ScenarioSpec(
        "burst",
        f"chat beside batch at capacity, {6 * SLOTS} calls at once",
        Mix(long_share=0.3, long_prompts=False),
        1.0,
        Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=20.0),
        burst=6 * SLOTS,
    ),
    # The peers' named workloads (llm_backoff_shim.lab.workloads), each calibrated on its own lengths.
    "shared-prefix": ScenarioSpec(
        "shared-prefix",
        "inference-perf's shared prefix, 70 % interactive, 2.5x capacity",
        Mix(long_share=0.3, long_prompts=False, workload=WORKLOADS["shared-prefix"]),
        2.5,
        Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=20.0),
        calibration="shared-prefix",
    ),
    "bimodal": ScenarioSpec(
        "bimodal",
        "inference-perf's bimodal: 30 % 1k-token prompts with 512-token answers as batch, 3x capacity",
        Mix(long_share=0.3, workload=WORKLOADS["bimodal"]),
        3.0,
        Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=40.0),
        calibration="bimodal",
    ),
    "batch-gateway": ScenarioSpec(
        "batch-gateway",
        "llm-d batch gateway: interactive bursts at 3.3x capacity then 0.2x, beside batch; 2.5x in all",
        # Its batch prompts are shorter than its interactive ones: one speed fitted on the whole
        # mix (prefill fitted on decode-bound batch calls priced the 512-token chats 8x too dear).
        Mix(long_share=0.3, long_prompts=False, workload=WORKLOADS["batch-gateway"]),
        2.5,
        Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=60.0),
        calibration="batch-gateway",
    ),
    "tenants": ScenarioSpec(
        "tenants",
        "one tenant floods chat at 5x capacity beside three quiet tenants at 0.1x each",
        Mix(long_share=0.0, long_prompts=False),
        5.0,
        Budgets(chat_ttft=5.0, chat_deadline=20.0, long_deadline=20.0),
        quiet=(0.1, 0.1, 0.1),
    ),
}


#: The scoreboard docs/benchmarks.md shows, run by default; the others answer their own questions.
CANONICAL = ("chat", "mix", "burst")
#: The scenario on a fleet of simulated replicas behind load balancers (``fleet_scenario``).
FLEET = "fleet"


@dataclass(frozen=True)
class Arm:
    name: str
    setup: Setup
    #: Shim flags after calibrate's (a later flag wins): ``--try``'s variants.
    extra: tuple[str, ...] = ()
    #: The interpreter whose install of the shim runs (``--try-python``), else this one's.
    python: str | None = None


ARMS = {
    "direct-plain": Arm("direct-plain", Setup("plain openai -> vLLM's bound", "engine", "plain")),
    "direct-presets": Arm(
        "direct-presets", Setup("llm_backoff presets -> vLLM's bound", "engine", "llm_backoff_presets")
    ),
    "shim-plain": Arm("shim-plain", Setup("plain openai -> shim", "shim", "plain")),
    "shim-presets": Arm("shim-presets", Setup("llm_backoff presets -> shim", "shim", "llm_backoff_presets")),
}


@dataclass
class Row:
    scenario: str
    seed: int
    arm: str
    label: str
    useful_tokens: int
    chat_calls: int
    chat_in_budget: int
    batch_calls: int
    batch_served: int
    refusal_p90: float | None
    wasted: float | None
    load: float
    oracle_useful: int = 0
    oracle_chat: int = 0
    oracle_batch: int = 0
    diagnostics: dict[str, object] = dataclasses.field(default_factory=dict)


def engine_params(flags: str) -> EngineParams:
    """The engine model of ``llm-backoff-shim sim`` run with ``flags``."""
    return config_from_args(parse_args(shlex.split(flags))).engine_params()


def at_speed(params: EngineParams, decode: float, prefill: float) -> EngineParams:
    """``params`` with its per-step and per-request costs ``decode`` times as fast and its
    per-prompt-token costs ``prefill`` times as fast: the oracle on the engine this run measured."""
    return dataclasses.replace(
        params,
        ttft=params.ttft / decode,
        itl=params.itl / decode,
        admit_time=params.admit_time / decode,
        decode_attention_time=params.decode_attention_time / decode,
        prefill_time_per_token=params.prefill_time_per_token / prefill,
        prefill_attention_time=params.prefill_attention_time / prefill,
    )


#: Full-load windows per workload (their median is taken) and each window's seconds.
SPEED_WINDOWS = 3


def measured_tokens(url: str, model: str, workload: MixWorkload, seconds: float) -> float:
    """The engine's answer tokens/s with every slot busy on ``workload``: the median of
    :data:`SPEED_WINDOWS` windows (one window moved by 10-15 % on this shared machine)."""
    return statistics.median(
        full_load_tokens_per_s(url, model, workload, slots=SLOTS, seconds=seconds, seed=i)  # type: ignore[arg-type]
        for i in range(SPEED_WINDOWS)
    )


def fit_speeds(
    params: EngineParams, mix: Mix, chat_tokens: float, long_tokens: float | None
) -> tuple[float, float]:
    """The model's decode and prefill speeds that reproduce the engine's full-load answer tokens/s
    on chat calls alone (``chat_tokens``) and on long-prompt calls alone (``long_tokens``; None:
    the mix has none, and prefill keeps decode's speed).

    Two speeds, not one: on the CPU vLLM the fitted model prices a long prompt's prefill about
    1.4x too dear against decode (chat alone ran at 1.25-1.4x the model, long prompts alone at
    1.8x), so one speed fitted on the mix made the oracle's chats faster than the engine's.
    Decode is fitted on chat (its prefill is a few dozen tokens), then prefill on long prompts
    by bisection (the model's capacity rises with it)."""
    decode = chat_tokens / capacity(params, mix, only="chat" if mix.long_prompts else None)[1]
    if long_tokens is None:
        return decode, decode
    low, high = decode / 8, decode * 8
    for _ in range(30):
        mid = math.sqrt(low * high)
        if capacity(at_speed(params, decode, mid), mix, only="long")[1] < long_tokens:
            low = mid
        else:
            high = mid
    return decode, math.sqrt(low * high)


def queued_tokens_bound(params: EngineParams, budgets: Budgets) -> int:
    """vLLM's rule for ``--max-num-queued-tokens``: the TTFT target (the chat budget) times the
    engine's prefill rate (the fitted model's)."""
    per_token = params.prefill_time_per_token + params.prefill_attention_time
    return int(budgets.chat_ttft / per_token)


def tokens_per_word(url: str, model: str) -> float:
    """The engine's tokenizer on the load generator's words (``/tokenize``; the simulator's
    default when it has none)."""
    from llm_backoff_shim.lab.workload import prompt_text

    text = prompt_text(1000, random.Random(0))
    try:
        answer = httpx.post(url + "/tokenize", json={"model": model, "prompt": text}, timeout=30)
        return float(answer.json()["count"]) / 1000
    except (httpx.HTTPError, KeyError, ValueError):
        return Mix().tokens_per_word


@dataclass(frozen=True)
class Calibration:
    kind: str
    flags: list[str]
    command: str
    confidence: str
    seconds: float


def run_calibrate(url: str, kind: str, mix: Mix, *, max_seconds: float) -> Calibration:
    """``llm-backoff-shim calibrate`` with its defaults and the traffic's lengths (the mix's long
    prompts given in the engine's words for its tokens; a named workload's lengths likewise)."""
    args = ["--upstream", url, "--max-seconds", f"{max_seconds:g}"]
    if mix.workload is not None:
        args += mix.workload.calibrate_flags(mix.tokens_per_word)
    elif kind == "mix":
        low, high = (round(t / mix.tokens_per_word) for t in (1500, 3000))
        args += ["--long-share", f"{mix.long_share:g}", "--long-prompt-words", f"{low}-{high}"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        argv = cli_command("calibrate", *args, "--out", tmp, "--json")
        print("$ llm-backoff-shim " + " ".join(argv[argv.index("calibrate") :]), flush=True)
        done = subprocess.run(argv, stdout=subprocess.PIPE, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"calibrate ({kind}) found no recommendation (exit {done.returncode})")
    data: dict[str, Any] = json.loads(done.stdout)
    command = str(data["recommendation"]["command"])
    words = shlex.split(command)
    flags = words[words.index("--upstream") + 2 :]
    return Calibration(kind, flags, command, str(data.get("confidence")), time.monotonic() - started)


def arrivals(trace: Sequence[MixCall], seed: int, owners: Mapping[int, str] | None = None) -> list[Arrival]:
    """The trace as the load generator plays it: each call's prompt, a ``max_tokens`` of 4096 or
    none, the answer's drawn length as where its caller stops reading, and its tenant's API key
    (``owners``, by call index)."""
    rng = random.Random(seed + 1000)
    owners = owners or {}
    return [
        Arrival(
            c.index,
            c.at,
            "interactive" if c.kind == "chat" else "batch",
            c.prompt(rng),
            rng.choice(SENT_MAX_TOKENS),
            True,
            c.max_tokens,
            None if c.index not in owners else f"sk-{owners[c.index]}",
        )
        for c in trace
    ]


def tenant_trace(
    spec: ScenarioSpec, mix: Mix, seed: int, calls_per_s: float, duration: float
) -> tuple[list[MixCall], dict[int, str]]:
    """The flooding tenant's trace at ``rate_factor`` x capacity beside each quiet tenant's at its
    factor (a seed each), merged in time order; and each call's tenant, by index."""
    parts = [("flood", spec.rate_factor), *((f"quiet-{i + 1}", f) for i, f in enumerate(spec.quiet))]
    calls = [
        (call, name)
        for n, (name, factor) in enumerate(parts)
        for call in mix_trace(mix, seed * 100 + n, rate=factor * calls_per_s, duration=duration)
    ]
    calls.sort(key=lambda pair: pair[0].at)
    trace = [dataclasses.replace(call, index=i) for i, (call, _) in enumerate(calls)]
    return trace, {i: name for i, (_, name) in enumerate(calls)}


def alone(trace: Sequence[MixCall], owners: Mapping[int, str], name: str) -> list[MixCall]:
    """Tenant ``name``'s calls of ``trace``, reindexed: its trace with the box to itself."""
    mine = [c for c in trace if owners[c.index] == name]
    return [dataclasses.replace(c, index=i) for i, c in enumerate(mine)]


def max_min_fair(total: float, demands: Mapping[str, int]) -> dict[str, float]:
    """``total`` split max-min fair over ``demands``: nobody more than it asked, the rest evenly."""
    share: dict[str, float] = {}
    pending = sorted(demands, key=demands.__getitem__)
    while pending:
        each = total / len(pending)
        if demands[pending[0]] > each:
            share.update(dict.fromkeys(pending, each))
            break
        name = pending.pop(0)
        share[name] = demands[name]
        total -= demands[name]
    return share


def jain(row: Row) -> float | None:
    """Jain's fairness index over the tenants' chats within budget, each as a share of its
    max-min fair split of them all (1: exactly fair; 1/n: one tenant had it all)."""
    counts: dict[str, list[int]] = row.diagnostics.get("tenants", {})  # type: ignore[assignment]
    fair = max_min_fair(sum(ok for ok, _ in counts.values()), {t: n for t, (_, n) in counts.items()})
    xs = [counts[t][0] / f for t, f in fair.items() if f > 0]
    squares = sum(x * x for x in xs)
    return None if not squares else sum(xs) ** 2 / (len(xs) * squares)


def wasted(result: RunResult) -> float | None:
    """The engine's answer tokens that no completed call received, of all it generated (the
    engine's own counter; a caller closing its stream at its answer's length may leave the
    step in flight, a token or so, counted here too, alike for every arm)."""
    generated = result.engine_stats.get("tokens_generated")
    if not generated:
        return None
    delivered = sum(r.tokens for r in result.calls if r.ok)
    return max(0.0, float(generated) - delivered) / float(generated)


def diagnose(result: RunResult) -> dict[str, object]:
    """Where chat was lost: how the interactive calls that failed ended (with their p90 time),
    refusals per class and code over every attempt, idle slot-time while a caller waited, the
    engine's answer tokens/s with every slot busy at this run's pace (beside the capacity the
    oracle is scaled to: a slower engine in the arm's run, not its admission, then explains
    a gap)."""
    refusals: dict[str, int] = {}
    for r in result.calls:
        for a in r.attempts:
            if a.status is not None and a.status >= 400:
                key = f"{r.cls}:{a.code or a.status}"
                refusals[key] = refusals.get(key, 0) + 1
    late = sum(1 for r in result.calls if r.cls == "interactive" and r.ok and not r.within_budget)
    ttfts = [r.ttft for r in result.calls if r.cls == "interactive" and r.ok and r.ttft is not None]
    paths = {
        k: [n, None if p is None else round(p, 2)] for k, (n, p) in interactive_failure_paths(result).items()
    }
    return {
        "interactive_failed": paths,
        "interactive_served_late": late,
        "refusals": refusals,
        "idle_caller_waiting": idle_slot_share(result, SLOTS),
        "engine_pace": engine_pace(result, SLOTS),
        "served_chat_ttft_p50_p90_max": [
            None if v is None else round(v, 2)
            for v in (percentile(ttfts, 50), percentile(ttfts, 90), max(ttfts, default=None))
        ],
    }


def chat_ok(spec: ScenarioSpec, r: CallRecord) -> bool:
    """A chat call served within its time-to-first-token budget."""
    return r.ok and r.ttft is not None and r.ttft <= spec.budgets.chat_ttft


def row_of(spec: ScenarioSpec, seed: int, arm: Arm, result: RunResult, load: float) -> Row:
    chats = [r for r in result.calls if r.cls == "interactive"]
    batch = [r for r in result.calls if r.cls == "batch"]

    refused = [r.duration for r in chats if not r.ok and r.duration is not None]
    return Row(
        scenario=spec.name,
        seed=seed,
        arm=arm.name,
        label=arm.setup.label,
        useful_tokens=sum(r.tokens for r in chats if chat_ok(spec, r)) + sum(r.tokens for r in batch if r.ok),
        chat_calls=len(chats),
        chat_in_budget=sum(chat_ok(spec, r) for r in chats),
        batch_calls=len(batch),
        batch_served=sum(r.ok for r in batch),
        refusal_p90=percentile(refused, 90),
        wasted=wasted(result),
        load=load,
    )


def run_arm(
    arm: Arm,
    spec: ScenarioSpec,
    trace: Sequence[MixCall],
    seed: int,
    url: str,
    model: str,
    flags: Sequence[str],
    calls_per_s: float,
    owners: Mapping[int, str] | None = None,
) -> Row:
    b = spec.budgets
    scen = Scenario(
        f"scoreboard-{spec.name}",
        burst=0,
        rate_factor=spec.rate_factor,
        duration=max(c.at for c in trace),
        deadline=b.chat_deadline,
        ttft_budget=b.chat_ttft,
        interactive_share=1 - spec.mix.long_share,
        start_deadline=False,
        batch_deadline=b.long_deadline,
    )
    with contextlib.ExitStack() as stack:
        front: ChildServer | None = None
        if arm.setup.route == "shim":
            front = stack.enter_context(shim_server(url, [*flags, *arm.extra], python=arm.python))
        load = os.getloadavg()[0]
        line = ProgressLine(sys.stderr, f"{spec.name} seed {seed} / {arm.name}")
        run = LoadRun(
            arm.setup,
            scen,
            arrivals(trace, seed, owners),
            target_url=url if front is None else front.url,
            engine_url=url,
            shim_url=None if front is None else front.url,
            capacity=calls_per_s,
            model=model,
            progress=line,
            start_deadline=False,
        )
        result = run_load(run)
        line.done()
    row = row_of(spec, seed, arm, result, load)
    row.diagnostics = diagnose(result)
    if owners:
        counts = {name: [0, 0] for name in sorted(set(owners.values()))}
        for r in result.calls:
            counts[owners[r.index]][0] += chat_ok(spec, r)
            counts[owners[r.index]][1] += 1
        row.diagnostics["tenants"] = counts
    print(
        f"  {arm.setup.label}: useful {row.useful_tokens}, chat {row.chat_in_budget}/{row.chat_calls} "
        f"within budget, batch {row.batch_served}/{row.batch_calls}, refusal p90 "
        f"{_s(row.refusal_p90)}, wasted {_pct(row.wasted)} (load {load:.1f}, {result.elapsed:.0f} s)",
        flush=True,
    )
    print(f"    {json.dumps(row.diagnostics)}", flush=True)
    return row


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _ratio(a: float, b: float) -> str:
    return "-" if b <= 0 else f"{a / b:.2f}"


def table(rows: Sequence[Row], scenarios: Sequence[str], arms: Sequence[str]) -> str:
    """Per scenario and arm, each seed's figures joined by ' / ': chat within budget (and of
    the oracle's), useful tokens of the oracle's, batch served (of the oracle's), refusal p90,
    wasted; the presets through the shim over plain openai at vLLM's bound."""
    lines = [
        "| scenario | arm | chat within budget (oracle's) | chat of oracle's | useful tokens of oracle's "
        "| batch served (oracle's) | interactive refusal p90 | engine work wasted |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for sc in scenarios:
        mine = [r for r in rows if r.scenario == sc]
        if not mine:
            continue
        seeds = sorted({r.seed for r in mine})
        for arm in arms:
            cells = [next(r for r in mine if r.arm == arm and r.seed == s) for s in seeds]
            lines.append(
                f"| {sc} | {cells[0].label} | "
                + " | ".join(
                    " / ".join(parts)
                    for parts in (
                        [f"{c.chat_in_budget} ({c.oracle_chat})" for c in cells],
                        [_ratio(c.chat_in_budget, c.oracle_chat) for c in cells],
                        [_ratio(c.useful_tokens, c.oracle_useful) for c in cells],
                        [f"{c.batch_served}/{c.batch_calls} ({c.oracle_batch})" for c in cells],
                        [_s(c.refusal_p90) for c in cells],
                        [_pct(c.wasted) for c in cells],
                    )
                )
                + " |"
            )
        if {"shim-presets", "direct-plain"} <= set(arms):
            ratio_chat, ratio_useful = [], []
            for s in seeds:
                p = next(r for r in mine if r.arm == "shim-presets" and r.seed == s)
                d = next(r for r in mine if r.arm == "direct-plain" and r.seed == s)
                ratio_chat.append(_ratio(p.chat_in_budget, d.chat_in_budget))
                ratio_useful.append(_ratio(p.useful_tokens, d.useful_tokens))
            lines.append(
                f"| {sc} | presets -> shim over plain -> vLLM's bound | {' / '.join(ratio_chat)} | | "
                f"{' / '.join(ratio_useful)} | | | |"
            )
    return "\n".join(lines)


def tenants_table(
    rows: Sequence[Row], arms: Sequence[str], alone_counts: Mapping[int, Mapping[str, int]]
) -> str:
    """The tenants scenario per arm and seed: the flooding tenant's chats within budget of its
    calls, each quiet tenant's and of its trace played alone, all chats within budget (what the
    engine served in time: the flooding tenant has what the quiet ones left of it), Jain's index."""
    quiet = sorted({name for counts in alone_counts.values() for name in counts})
    lines = [
        "| tenants: arm | seed | flooding tenant within budget | "
        + " | ".join(f"{q} within budget (of alone)" for q in quiet)
        + " | all within budget | Jain's index |",
        "|---|---:|---:|" + "---:|" * len(quiet) + "---:|---:|",
    ]
    for arm in arms:
        for row in (r for r in rows if r.scenario == "tenants" and r.arm == arm):
            counts: dict[str, list[int]] = row.diagnostics["tenants"]  # type: ignore[assignment]
            flood_ok, flood_calls = counts["flood"]
            cells = [f"{flood_ok}/{flood_calls}"]
            for q in quiet:
                by_itself = alone_counts[row.seed][q]
                cells.append(f"{counts[q][0]}/{counts[q][1]} ({_ratio(counts[q][0], by_itself)})")
            index = jain(row)
            lines.append(
                f"| {row.label} | {row.seed} | "
                + " | ".join(cells)
                + f" | {row.chat_in_budget} | {'-' if index is None else f'{index:.2f}'} |"
            )
    return "\n".join(lines)


def plot(rows: Sequence[Row], scenarios: Sequence[str], arms: Sequence[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    width = 0.8 / max(1, len(arms))
    for ax, (what, num) in zip(
        axes,
        (
            ("chat calls within budget / the oracle's", lambda r: (r.chat_in_budget, r.oracle_chat)),
            ("useful tokens / the oracle's", lambda r: (r.useful_tokens, r.oracle_useful)),
        ),
        strict=True,
    ):
        for i, arm in enumerate(arms):
            xs, ys, lows, highs = [], [], [], []
            for j, sc in enumerate(scenarios):
                vals = [
                    a / b for a, b in (num(r) for r in rows if r.scenario == sc and r.arm == arm) if b > 0
                ]
                if not vals:
                    continue
                mid = statistics.median(vals)
                xs.append(j + (i - (len(arms) - 1) / 2) * width)
                ys.append(mid)
                lows.append(mid - min(vals))
                highs.append(max(vals) - mid)
            label = ARMS[arm].setup.label
            ax.bar(xs, ys, width, yerr=[lows, highs], label=label, capsize=2)
        ax.axhline(1.0, color="k", lw=1)
        ax.axhline(0.95, color="k", ls=":", lw=1)
        ax.set_xticks(range(len(scenarios)), list(scenarios))
        ax.set_title(what, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 170), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fleet_json(fleet: fleet_scenario.FleetReport) -> dict[str, object]:
    return {
        "head": fleet.head,
        "shim_flags": fleet.shim_flags,
        "cells": [dataclasses.asdict(c) for c in fleet.cells],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--quick", action="store_true", help="1 seed, 12 s of arrivals, calibrate capped at 90 s")
    add("--engine", choices=("auto", "vllm", "sim"), default="auto", help="auto: vLLM when set up, else sim")
    add("--seeds", type=int, help="how many seeds (default 2, 1 with --quick)")
    add("--first-seed", type=int, default=11)
    add("--duration", type=float, help="seconds of arrivals (default 20, 12 with --quick)")
    add(
        "--scenarios",
        default=",".join(CANONICAL),
        help=f"of {', '.join([*SCENARIOS, FLEET])} (default: the scoreboard's, {', '.join(CANONICAL)})",
    )
    add("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    add(
        "--try",
        dest="variants",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more arm: the presets through the shim with calibrate's flags and then FLAGS "
        "(e.g. c9='--max-concurrency 9'), on the same traces as every arm; repeatable",
    )
    add(
        "--try-python",
        action="append",
        default=[],
        metavar="NAME=PYTHON",
        help="run --try variant NAME's shim with PYTHON's install of it (another tree: a "
        "before/after of the code in one run)",
    )
    add("--calibrate-seconds", type=float, help="calibrate's --max-seconds (default 150, 90 with --quick)")
    add("--engine-url", help="a running engine (8 slots, the bounds above) instead of starting one")
    add("--out", type=Path, default=Path("docs/img"))
    add("--name", default="scoreboard")
    return p


def start_engine(kind: str, stack: contextlib.ExitStack, pinned: bool, queued_tokens: int) -> str:
    bounds = ("--max-num-queued-reqs", str(QUEUED_REQS))
    if kind == "sim":
        return stack.enter_context(sim_server([*shlex.split(FITTED_ENGINE_FLAGS), *bounds])).url
    ensure_setup(DEFAULT_ENV, DEFAULT_MODEL)
    print("starting vllm serve (about 25 s) ...", flush=True)
    queued = ("--max-num-queued-tokens", str(queued_tokens))
    extra = ("--max-model-len", str(MAX_MODEL_LEN), *bounds, *queued, "--no-enable-prefix-caching")
    return stack.enter_context(vllm_server(slots=SLOTS, cpu=ENGINE_CPU if pinned else None, extra=extra)).url


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scenarios = args.scenarios.split(",")
    arms = args.arms.split(",")
    pythons = dict(p.partition("=")[::2] for p in args.try_python)
    for variant in args.variants:
        name, _, extra = variant.partition("=")
        python = pythons.get(name)
        ARMS["shim-presets+" + name] = Arm(
            "shim-presets+" + name,
            Setup(f"presets -> shim, {name}: {extra or python}", "shim", "llm_backoff_presets"),
            tuple(shlex.split(extra)),
            python,
        )
        arms.append("shim-presets+" + name)
    unknown = (set(scenarios) - {*SCENARIOS, FLEET}) | (set(arms) - set(ARMS))
    if unknown:
        print(f"scoreboard: unknown {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if FLEET in scenarios and fleet_scenario.missing():
        lacking = " ".join(fleet_scenario.missing())
        print(f"scoreboard: the fleet scenario needs {lacking} (apt-get install {lacking})", file=sys.stderr)
        return 2
    on_engine = [s for s in scenarios if s in SCENARIOS]
    kind = args.engine if args.engine != "auto" else ("vllm" if ready(DEFAULT_ENV, DEFAULT_MODEL) else "sim")
    seeds = list(range(args.first_seed, args.first_seed + (args.seeds or (1 if args.quick else 2))))
    duration = args.duration or (12.0 if args.quick else 20.0)
    calib_seconds = args.calibrate_seconds or (90.0 if args.quick else 150.0)
    params = engine_params(FITTED_ENGINE_FLAGS)
    started = time.monotonic()
    cpus = os.sched_getaffinity(0)
    pinned = LOAD_CPU in cpus and len(cpus) >= 2
    if pinned:
        os.sched_setaffinity(0, {LOAD_CPU})
    rows: list[Row] = []
    calibrations: dict[str, Calibration] = {}
    speeds: dict[str, dict[str, float]] = {}
    fitted: dict[Mix, tuple[float, float]] = {}
    alone_counts: dict[int, dict[str, int]] = {}
    queued_tokens = queued_tokens_bound(params, SCENARIOS["chat"].budgets)
    fleet: fleet_scenario.FleetReport | None = None
    try:
        with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
            if on_engine:
                url = (
                    args.engine_url.rstrip("/")
                    if args.engine_url
                    else start_engine(kind, stack, pinned, queued_tokens)
                )
                model = str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])
                tpw = tokens_per_word(url, model)
                print(
                    f"engine: {kind} at {url} ({SLOTS} slots, --max-num-queued-reqs {QUEUED_REQS}"
                    + (f", --max-num-queued-tokens {queued_tokens}" if kind == "vllm" else "")
                    + f"); {tpw:.2f} tokens per word",
                    flush=True,
                )
            for name in on_engine:
                spec = SCENARIOS[name]
                mix = dataclasses.replace(spec.mix, tokens_per_word=tpw)
                if spec.calibration not in calibrations:
                    calibrations[spec.calibration] = run_calibrate(
                        url, spec.calibration, mix, max_seconds=calib_seconds
                    )
                    c = calibrations[spec.calibration]
                    print(f"calibrate ({c.kind}, {c.seconds:.0f} s, {c.confidence}): {' '.join(c.flags)}")
                flags = calibrations[spec.calibration].flags
                if mix not in fitted:
                    window = 4.0 if args.quick else 6.0
                    chat_tokens = measured_tokens(
                        url, model, MixWorkload(mix, "chat" if mix.long_prompts else None), window
                    )
                    long_tokens = (
                        measured_tokens(url, model, MixWorkload(mix, "long"), window)
                        if mix.long_prompts
                        else None
                    )
                    fitted[mix] = fit_speeds(params, mix, chat_tokens, long_tokens)
                decode, prefill = fitted[mix]
                engine = at_speed(params, decode, prefill)
                real_calls, real_tokens = capacity(engine, mix)
                speeds[name] = {"decode": decode, "prefill": prefill}
                rate = spec.rate_factor * real_calls
                print(
                    f"\n== {name}: {spec.title}; capacity {real_calls:.2f} calls/s "
                    f"({real_tokens:.0f} tokens/s: the fitted model at x{decode:.2f} its decode speed, "
                    f"x{prefill:.2f} its prefill speed), arrivals {rate:.2f}/s for {duration:g} s",
                    flush=True,
                )
                for seed in seeds:
                    owners = None
                    if spec.quiet:
                        trace, owners = tenant_trace(spec, mix, seed, real_calls, duration)
                    else:
                        trace = mix_trace(
                            mix,
                            seed,
                            rate=rate,
                            duration=duration,
                            burst=spec.burst,
                            burst_at=duration / 3,
                            burst_kind="long" if spec.mix.long_prompts else None,
                        )
                    best = oracle(trace, engine, spec.budgets)
                    print(
                        f"- seed {seed}: {len(trace)} calls; oracle {best.useful_tokens} useful tokens, chat "
                        f"{best.served.get('chat', 0)}/{best.offered.get('chat', 0)}, batch "
                        f"{best.served.get('long', 0)}/{best.offered.get('long', 0)}",
                        flush=True,
                    )
                    for name in sorted(set((owners or {}).values()) - {"flood"}):
                        assert owners is not None
                        print(f"  {name} alone (the box to itself):", flush=True)
                        solo = alone(trace, owners, name)
                        box = ARMS["direct-plain"]
                        by_itself = run_arm(box, spec, solo, seed, url, model, flags, real_calls)
                        alone_counts.setdefault(seed, {})[name] = by_itself.chat_in_budget
                    for arm in arms:
                        row = run_arm(ARMS[arm], spec, trace, seed, url, model, flags, real_calls, owners)
                        row.oracle_useful = best.useful_tokens
                        row.oracle_chat = best.served.get("chat", 0)
                        row.oracle_batch = best.served.get("long", 0)
                        rows.append(row)
        if FLEET in scenarios:
            # Its own processes on every CPU (the load generator's pinning is for one engine).
            os.sched_setaffinity(0, cpus)
            with sigterm_as_interrupt():
                fleet = fleet_scenario.run(duration, seeds[0])
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130
    except (ServerStartError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"scoreboard: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ("-sim" if kind == "sim" and on_engine else "")
    if fleet is not None:
        # Files of its own: a fleet-only run leaves the scoreboard's table where it is.
        stem = args.out / f"{args.name}-fleet{suffix}"
        print("\n" + fleet.head + "\n\n" + fleet.table)
        fleet_scenario.plot(fleet.cells, stem.with_suffix(".png"), fleet.head)
        stem.with_suffix(".md").write_text(fleet.head + "\n\n" + fleet.table + "\n")
        stem.with_suffix(".json").write_text(json.dumps(fleet_json(fleet), indent=1) + "\n")
        print(f"\nplot: {stem.with_suffix('.png')}")
    if not on_engine:
        print(f"total {time.monotonic() - started:.0f} s")
        return 0
    shown = [s for s in scenarios if any(r.scenario == s for r in rows)]
    head = (
        f"{'real vLLM (CPU)' if kind == 'vllm' else 'the simulator (fitted to the CPU vLLM)'}, "
        f"{SLOTS} slots, "
        f"--max-num-queued-reqs {QUEUED_REQS}; seeds {', '.join(map(str, seeds))} (each cell: one figure per "
        f"seed); {duration:g} s of arrivals; calibrate: "
        + "; ".join(f"{c.kind} [{' '.join(c.flags)}] ({c.confidence})" for c in calibrations.values())
    )
    text = table(rows, shown, arms)
    if alone_counts:
        text += "\n\n" + tenants_table(rows, arms, alone_counts)
    print("\n" + head + "\n\n" + text)
    png = args.out / f"{args.name}{suffix}.png"
    plot(rows, shown, arms, png, head)
    (args.out / f"{args.name}{suffix}.md").write_text(head + "\n\n" + text + "\n")
    (args.out / f"{args.name}{suffix}.json").write_text(
        json.dumps(
            {
                "head": head,
                "engine": kind,
                "calibrations": {k: dataclasses.asdict(c) for k, c in calibrations.items()},
                "speeds": speeds,
                "rows": [dataclasses.asdict(r) for r in rows],
                "tenants_alone": alone_counts,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"\nplot: {png}\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
