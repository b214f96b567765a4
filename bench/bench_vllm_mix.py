"""Long prompts beside chat on a real vLLM: direct, the count cap, the cost cap, and the oracle.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_vllm_mix.py           # ~8 min
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_vllm_mix.py --quick   # ~3 min

Starts vLLM (CPU build, ``--max-num-seqs 8 --max-model-len 4096``) pinned to CPU 1, itself
and the shims on CPU 0, and plays one seeded trace (``real_vllm.mix``) against each arm:

- 80 % chat calls (interactive: prompts of 5-200 words, answers lognormal median 64;
  useful when the first token comes within 5 s and the answer within 20 s) and 20 %
  long-prompt calls (batch: prompts of 1.5-3k tokens, answers median 64; useful within
  60 s), Poisson at ``--rate-factor`` x the engine's capacity on this mix for
  ``--duration`` s, and a burst of ``--burst`` long-prompt calls at a third of it;
- arms (``--arms``): ``direct`` (plain openai straight at vLLM), ``count`` (plain openai
  through the shim with ``--count-flags``, the request-count cap sized for chat as
  calibrate recommends it), ``presets-count`` (the SDK's presets through that same shim)
  and ``presets-cost`` (the SDK's presets through the shim with ``--cost-flags``, the
  cost-aware cap); ``presets-cost2`` is the same with ``--cost2-flags``, to set two cost
  caps side by side on one trace;
- the oracle: the simulator's engine model with the flags fitted to this vLLM
  (``--engine-flags``, from ``bench/real_vllm/probe.py``) and an earliest-deadline-first
  scheduler that knows every call's cost (``real_vllm.mix.oracle``), on the same trace.
  The engine's capacity on the mix (the "1x") is measured on vLLM first (8 closed-loop
  workers, ``real_vllm.capacity``), beside the model's, for chat alone, long prompts alone
  and the mix; ``--capacity-calls-per-s`` states it instead.

Per arm: useful tokens (and of the oracle's), chat calls within budget, chat TTFT p99 of
the chats served (those that never saw a first token are counted apart, "never served") over
the run and over the burst (chat calls arriving in the 10 s after it, with how many of them
were served within budget), long-prompt calls served, engine work wasted (answer tokens vLLM
generated that no completed call received; prompt tokens it prefilled for calls that were
not served), and the engine's busy share (mean running sequences over 8, sampled) over the
whole run and while calls arrived, with the share of those samples in which the engine ran
any sequence. Writes ``docs/img/real-vllm-mix.{png,json,md}``.
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
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from llm_backoff_shim.lab.demo import ProgressLine
from llm_backoff_shim.lab.load_records import CallRecord, RunResult
from llm_backoff_shim.lab.loadgen import LoadRun, run_load
from llm_backoff_shim.lab.loadgen_engine import metric_sum
from llm_backoff_shim.lab.procs import (
    ChildServer,
    ServerStartError,
    cli_command,
    shim_server,
    sigterm_as_interrupt,
)
from llm_backoff_shim.lab.scenario import Arrival, Scenario, Setup
from llm_backoff_shim.sim.engine import EngineParams
from llm_backoff_shim.sim.server import config_from_args, parse_args
from real_vllm.capacity import full_load_tokens_per_s
from real_vllm.engine import DEFAULT_ENV, DEFAULT_MODEL, ensure_setup, vllm_server
from real_vllm.measures import idle_places, idle_slot_share, wasted_share
from real_vllm.mix import Budgets, Mix, MixCall, MixWorkload, capacity, mix_trace, oracle, p99

LOAD_CPU = 0
ENGINE_CPU = 1
SLOTS = 8
MAX_MODEL_LEN = 4096
BURST_WINDOW = 10.0

#: The simulator's flags fitted to this vLLM (docs/real-vllm.md): bench/real_vllm/probe.py's
#: prefill and decode figures, then --admit-time and --decode-attention-time to this benchmark's
#: own closed-loop capacities (chat, long prompts, the mix).
FITTED_ENGINE_FLAGS = (
    "--max-num-seqs 8 --ttft 0.018 --itl 0.0056 --itl-batch-factor 0.01 --prefill-time-per-token 0.000025 "
    "--prefill-attention-time 0.000085 --admit-time 0.06 --decode-attention-time 0.0005 "
    "--max-num-batched-tokens 2048 --kv-cache-tokens 131072"
)
#: calibrate's recommendation on the chat-only benchmark (docs/benchmarks.md, today's run).
COUNT_FLAGS = (
    "--max-concurrency 12 --max-queue 108 --max-queue-wait 0.75 --interactive-max-queue 5 "
    "--batch-max-queue 103 --batch-max-queue-wait 30 --retry-after-max 5"
)
#: The cost cap: about 8 slots of the mix's mean cost is 5,000; 3,500 keeps more of the long
#: prompts for after chat's peak, and delivered more on the same trace in every paired run
#: (docs/real-vllm.md, 'Long prompts beside chat').
COST_FLAGS = COUNT_FLAGS + " --max-inflight-tokens 3500"


@dataclass(frozen=True)
class Arm:
    name: str
    setup: Setup
    flags: str | None  # "count" / "cost": which shim flags; None: straight at the engine


ARMS = {
    "direct": Arm("direct", Setup("plain openai, direct", "engine", "plain"), None),
    "count": Arm("count", Setup("plain openai, shim (count cap)", "shim", "plain"), "count"),
    "presets-count": Arm(
        "presets-count",
        Setup("llm_backoff presets, shim (count cap)", "shim", "llm_backoff_presets"),
        "count",
    ),
    "presets-cost": Arm(
        "presets-cost", Setup("llm_backoff presets, shim (cost cap)", "shim", "llm_backoff_presets"), "cost"
    ),
    "presets-cost2": Arm(
        "presets-cost2",
        Setup("llm_backoff presets, shim (cost cap, second flags)", "shim", "llm_backoff_presets"),
        "cost2",
    ),
}


@dataclass
class Row:
    arm: str
    label: str
    useful_tokens: int
    of_oracle: float
    chat_calls: int
    chat_in_budget: int
    chat_ttft_p99: float
    chat_no_first_token: int
    burst_chat_calls: int
    burst_chat_in_budget: int
    burst_chat_ttft_p99: float
    long_calls: int
    long_served: int
    wasted_answer_share: float | None
    wasted_prompt_tokens: int | None
    engine_busy: float | None
    idle_caller_waiting: float | None
    #: While calls arrived: mean running sequences over the slots, and the share of samples
    #: with any sequence running (the engine stepping: with long prompts a step is a prefill
    #: chunk beside fewer sequences, so fewer running does not mean an idle engine).
    busy_while_arriving: float | None
    stepping_while_arriving: float | None
    load: float
    #: Why the engine idles (:func:`diagnose`).
    diagnostics: dict[str, object] = dataclasses.field(default_factory=dict)


def engine_params(flags: str) -> EngineParams:
    config = config_from_args(parse_args(shlex.split(flags)))
    return EngineParams(
        max_num_seqs=config.max_num_seqs,
        ttft=config.ttft,
        itl=config.itl,
        itl_batch_factor=config.itl_batch_factor,
        prefill_time_per_token=config.prefill_time_per_token,
        prefill_attention_time=config.prefill_attention_time,
        admit_time=config.admit_time,
        decode_attention_time=config.decode_attention_time,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_tokens=config.kv_cache_tokens,
    )


def at_speed(params: EngineParams, speed: float) -> EngineParams:
    """``params`` with every time divided by ``speed``: the same engine shape, ``speed`` times
    as fast (the fitted model at the speed vLLM measured in this run, for the second oracle)."""
    return dataclasses.replace(
        params,
        ttft=params.ttft / speed,
        itl=params.itl / speed,
        prefill_time_per_token=params.prefill_time_per_token / speed,
        prefill_attention_time=params.prefill_attention_time / speed,
        admit_time=params.admit_time / speed,
        decode_attention_time=params.decode_attention_time / speed,
    )


def prompt_tokens_total(url: str) -> float:
    """vLLM's count of prompt tokens it has prefilled (``vllm:prompt_tokens_total``)."""
    return metric_sum(httpx.get(url + "/metrics", timeout=10).text, "vllm:prompt_tokens_total") or 0.0


def tokens_per_word(url: str, model: str) -> float:
    """The engine's tokenizer on the load generator's words (vLLM's ``/tokenize``)."""
    from llm_backoff_shim.lab.workload import prompt_text

    text = prompt_text(1000, random.Random(0))
    count = httpx.post(url + "/tokenize", json={"model": model, "prompt": text}, timeout=30).json()["count"]
    return float(count) / 1000


def arrivals(calls: Sequence[MixCall], seed: int) -> list[Arrival]:
    rng = random.Random(seed + 1000)
    return [
        Arrival(
            c.index, c.at, "interactive" if c.kind == "chat" else "batch", c.prompt(rng), c.max_tokens, True
        )
        for c in calls
    ]


def _ttft_or_inf(c: CallRecord) -> float:
    return math.inf if c.ttft is None else c.ttft


def row_of(
    arm: Arm,
    result: RunResult,
    calls: Sequence[MixCall],
    oracle_tokens: int,
    budgets: Budgets,
    **extra: object,
) -> Row:
    kinds = {c.index: c for c in calls}
    chats = [r for r in result.calls if r.cls == "interactive"]
    longs = [r for r in result.calls if r.cls == "batch"]
    burst_at = min((c.at for c in calls if c.burst), default=math.inf)
    in_burst = [r for r in chats if burst_at <= kinds[r.index].at < burst_at + BURST_WINDOW]

    def chat_ok(r: CallRecord) -> bool:
        return r.ok and r.ttft is not None and r.ttft <= budgets.chat_ttft

    useful = sum(r.tokens for r in chats if chat_ok(r)) + sum(r.tokens for r in longs if r.ok)
    running = [s.engine_running for s in result.samples if s.engine_running is not None]
    last_arrival = max((c.at for c in calls), default=0.0)
    arriving = [
        s.engine_running for s in result.samples if s.engine_running is not None and s.t <= last_arrival
    ]
    return Row(
        arm=arm.name,
        label=arm.setup.label,
        useful_tokens=useful,
        of_oracle=useful / oracle_tokens if oracle_tokens else math.nan,
        chat_calls=len(chats),
        chat_in_budget=sum(chat_ok(r) for r in chats),
        chat_ttft_p99=p99([r.ttft for r in chats if r.ttft is not None]),
        chat_no_first_token=sum(r.ttft is None for r in chats),
        burst_chat_calls=len(in_burst),
        burst_chat_in_budget=sum(chat_ok(r) for r in in_burst),
        burst_chat_ttft_p99=p99([r.ttft for r in in_burst if r.ttft is not None]),
        long_calls=len(longs),
        long_served=sum(r.ok for r in longs),
        wasted_answer_share=wasted_share(result),
        engine_busy=statistics.fmean(running) / SLOTS if running else None,
        idle_caller_waiting=idle_slot_share(result, SLOTS),
        busy_while_arriving=statistics.fmean(arriving) / SLOTS if arriving else None,
        stepping_while_arriving=sum(n > 0 for n in arriving) / len(arriving) if arriving else None,
        **extra,  # type: ignore[arg-type]
    )


def diagnose(result: RunResult) -> dict[str, object]:
    """What an arm's shim held and refused: answer tokens asked for (``max_tokens``) beside
    those received, the shim's cost in flight (mean and share of samples within a chat's cost
    of the budget), requests in flight per class, and the refusals per class and code."""
    served = [r for r in result.calls if r.ok]
    asked = sum(r.max_tokens or 0 for r in served)
    got = sum(r.tokens for r in served)
    samples = [s for s in result.samples if s.proxy_in_flight_by_class]
    tokens = [s.proxy_in_flight_tokens for s in samples if s.proxy_in_flight_tokens is not None]
    refusals: dict[str, int] = {}
    for r in result.calls:
        for a in r.attempts:
            if a.status is not None and a.status >= 400:
                key = f"{r.cls}:{a.code or a.status}"
                refusals[key] = refusals.get(key, 0) + 1
    out: dict[str, object] = {
        "answer_tokens_asked": asked,
        "answer_tokens_received": got,
        "refusals": refusals,
    }
    if samples:
        for cls in ("interactive", "batch"):
            out[f"in_flight_{cls}_mean"] = round(
                statistics.fmean(s.proxy_in_flight_by_class.get(cls, 0) for s in samples), 2
            )
        out["shim_queued_mean"] = round(statistics.fmean(s.proxy_queued or 0 for s in samples), 2)
        held = [sum(s.proxy_in_flight_by_class.values()) for s in samples]
        out["shim_in_flight_max"] = max(held)
        out["shim_at_its_max_share"] = round(sum(h >= max(held) for h in held) / len(held), 3)
        out["engine_running_mean"] = round(statistics.fmean(s.engine_running or 0 for s in samples), 2)
        out["engine_waiting_mean"] = round(statistics.fmean(s.engine_waiting or 0 for s in samples), 2)
    places = idle_places(result, SLOTS)
    if places is not None:
        out["idle_while_caller"] = {k: round(v, 3) for k, v in places.items()}
    if tokens:
        out["in_flight_tokens_mean"] = round(statistics.fmean(tokens))
        out["in_flight_tokens_p90"] = sorted(tokens)[int(0.9 * (len(tokens) - 1))]
    return out


def run_arm(
    arm: Arm,
    scen: Scenario,
    trace: Sequence[MixCall],
    seed: int,
    url: str,
    model: str,
    flags: dict[str, str],
    capacity_calls: float,
    oracle_tokens: int,
    budgets: Budgets,
    pythons: dict[str, str],
) -> tuple[Row, RunResult]:
    with contextlib.ExitStack() as stack:
        front: ChildServer | None = None
        if arm.flags is not None:
            python = pythons.get(arm.flags)
            front = stack.enter_context(shim_server(url, shlex.split(flags[arm.flags]), python))
        load = os.getloadavg()[0]
        shown = "" if arm.flags is None else f" [{flags[arm.flags]}]"
        print(f"- {arm.setup.label}{shown}: {len(trace)} calls (machine load {load:.1f})", flush=True)
        before = prompt_tokens_total(url)
        line = ProgressLine(sys.stderr, arm.name)
        run = LoadRun(
            arm.setup,
            scen,
            arrivals(trace, seed),
            target_url=url if front is None else front.url,
            engine_url=url,
            shim_url=None if front is None else front.url,
            capacity=capacity_calls,
            model=model,
            progress=line,
            start_deadline=False,
        )
        result = run_load(run)
        line.done()
        prefilled = prompt_tokens_total(url) - before
    served_prompts = sum(
        r.prompt_tokens
        for r in result.calls
        if r.ok and (r.cls == "batch" or (r.ttft is not None and r.ttft <= budgets.chat_ttft))
    )
    row = row_of(
        arm, result, trace, oracle_tokens, budgets,
        wasted_prompt_tokens=max(0, int(prefilled) - served_prompts), load=load,
        diagnostics=diagnose(result),
    )  # fmt: skip
    print(
        f"  useful {row.useful_tokens} tokens ({row.of_oracle:.2f} of the oracle's), chat "
        f"{row.chat_in_budget}/{row.chat_calls} within budget (TTFT p99 of the served "
        f"{row.chat_ttft_p99:.2f} s, "
        f"{row.chat_no_first_token} never served; burst "
        f"{row.burst_chat_in_budget}/{row.burst_chat_calls}, p99 {row.burst_chat_ttft_p99:.2f} s), long "
        f"{row.long_served}/{row.long_calls}, engine busy {_pct(row.engine_busy)} (while calls arrived "
        f"{_pct(row.busy_while_arriving)}, stepping {_pct(row.stepping_while_arriving)}), answer tokens "
        f"wasted {_pct(row.wasted_answer_share)}, prompt tokens wasted {row.wasted_prompt_tokens} "
        f"({result.elapsed:.0f} s)\n  diagnostics {json.dumps(row.diagnostics)}",
        flush=True,
    )
    return row, result


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _s(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:.2f} s"


def _num(row: dict[str, object], key: str) -> float:
    value = row[key]
    assert isinstance(value, int | float), (key, value)
    return float(value)


def markdown(
    rows: Sequence[Row], oracle_row: dict[str, object], fast_row: dict[str, object] | None = None
) -> str:
    lines = [
        "| arm | useful tokens | of the oracle's | chat within 5 s TTFT | chat TTFT p99, served | "
        "chat never served | burst: chat within budget | burst: chat TTFT p99, served | long-prompt calls "
        "served | answer tokens wasted | prompt tokens wasted | engine busy | while calls arrived: busy, "
        "stepping |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.useful_tokens / 1000:.1f}k | {r.of_oracle:.2f} | "
            f"{r.chat_in_budget}/{r.chat_calls} "
            f"| {_s(r.chat_ttft_p99)} | {r.chat_no_first_token} | "
            f"{r.burst_chat_in_budget}/{r.burst_chat_calls} | "
            f"{_s(r.burst_chat_ttft_p99)} | {r.long_served}/{r.long_calls} | {_pct(r.wasted_answer_share)} | "
            f"{r.wasted_prompt_tokens / 1000:.1f}k | {_pct(r.engine_busy)} | "
            f"{_pct(r.busy_while_arriving)}, {_pct(r.stepping_while_arriving)} |"
        )
    base = _num(oracle_row, "useful_tokens")
    oracles = [("oracle (EDF on the fitted engine model)", oracle_row)]
    if fast_row is not None:
        label = f"oracle, the model at vLLM's measured speed (x{_num(fast_row, 'speed'):.2f})"
        oracles.append((label, fast_row))
    for label, o in oracles:
        useful = _num(o, "useful_tokens")
        lines.append(
            f"| {label} | {useful / 1000:.1f}k | {useful / base:.2f} | "
            f"{o['chat_served']}/{o['chat_offered']} | {_s(_num(o, 'chat_ttft_p99'))} | "
            f"{o['chat_never']} | | | "
            f"{o['long_served']}/{o['long_offered']} | | | | |"
        )
    return "\n".join(lines)


def plot(
    rows: Sequence[Row], results: Sequence[RunResult], trace: Sequence[MixCall], path: Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
    names = [r.label.replace(", ", ",\n") for r in rows]
    axes[0].bar(names, [r.of_oracle for r in rows], color="tab:blue")
    axes[0].axhline(1.0, color="k", lw=1)
    axes[0].axhline(0.95, color="k", ls=":", lw=1)
    axes[0].set(ylabel="useful tokens / the oracle's", title="useful tokens (dotted: the 0.95 target)")
    axes[0].tick_params(axis="x", labelsize=7)
    burst_at = min((c.at for c in trace if c.burst), default=None)
    for row, result in zip(rows, results, strict=True):
        chats = sorted((r for r in result.calls if r.cls == "interactive"), key=lambda r: r.scheduled)
        xs = [r.scheduled for r in chats]
        ys = [min(_ttft_or_inf(r), 30.0) for r in chats]
        axes[1].plot(xs, ys, ".", ms=3, label=row.label)
    if burst_at is not None:
        axes[1].axvspan(burst_at, burst_at + BURST_WINDOW, color="tab:red", alpha=0.08, label="burst window")
    axes[1].axhline(5.0, color="k", ls=":", lw=1)
    axes[1].set(xlabel="arrival, s", ylabel="chat TTFT, s (30 = never)", title="chat time to first token")
    axes[1].legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 180), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--quick", action="store_true", help="20 s of arrivals, a burst of 4")
    add("--seed", type=int, default=1)
    add("--duration", type=float, default=None, help="seconds of arrivals (default 45, 20 with --quick)")
    add("--rate-factor", type=float, default=2.0)
    add(
        "--burst", type=int, default=None, help="long-prompt calls at a third of the run (default 8, 4 quick)"
    )
    add("--arms", default="direct,count,presets-count,presets-cost", help=f"of {', '.join(ARMS)}")
    add("--count-flags", default=COUNT_FLAGS, help="the count-cap shim's flags (default %(default)s)")
    add("--cost-flags", default=COST_FLAGS, help="the cost-cap shim's flags (default %(default)s)")
    add(
        "--cost2-flags",
        default=COST_FLAGS,
        help="the presets-cost2 arm's shim flags: a second cost cap in the same run (default %(default)s)",
    )
    add("--cost2-label", default=None, help="the presets-cost2 arm's label in the table")
    add(
        "--cost2-python",
        default=None,
        help="the interpreter of the presets-cost2 arm's shim: another install of it (another build)",
    )
    add(
        "--engine-flags",
        default=FITTED_ENGINE_FLAGS,
        help="the sim's flags of the oracle (default %(default)s)",
    )
    add("--capacity-calls-per-s", type=float, help="the 1x of the load, stated instead of measured")
    add(
        "--capacity-seconds",
        type=float,
        default=10.0,
        help="closed-loop window per capacity measurement on vLLM (chat, long, the mix); 0: the model's",
    )
    add("--engine-url", help="a running vLLM (--max-num-seqs 8 --max-model-len 4096) instead of starting one")
    add("--out", type=Path, default=Path("docs/img"))
    add(
        "--replay", type=Path, help="a run's JSON: the oracle again on its trace with --engine-flags, no vLLM"
    )
    add("--name", default="real-vllm-mix")
    return p


def oracle_row_of(trace: Sequence[MixCall], params: EngineParams, budgets: Budgets) -> dict[str, object]:
    best = oracle(trace, params, budgets)
    return {
        "useful_tokens": best.useful_tokens,
        "chat_served": best.served.get("chat", 0),
        "chat_offered": best.offered.get("chat", 0),
        "long_served": best.served.get("long", 0),
        "long_offered": best.offered.get("long", 0),
        "chat_ttft_p99": p99(best.chat_ttfts),
        "chat_never": best.offered.get("chat", 0) - len(best.chat_ttfts),
        "generated": best.generated,
    }


def replay(path: Path, engine_flags: str) -> int:
    """The oracle again on a run's trace (its JSON), on another engine model; no vLLM."""
    data = json.loads(path.read_text())
    t = data["trace"]
    mix = Mix(tokens_per_word=float(t["tokens_per_word"]))
    trace = mix_trace(mix, int(t["seed"]), rate=float(t["rate"]), duration=float(t["duration"]),
                      burst=int(t["burst"]), burst_at=float(t["duration"]) / 3)  # fmt: skip
    params = engine_params(engine_flags)
    row = oracle_row_of(trace, params, Budgets())
    calls, tokens = capacity(params, mix)
    print(
        f"engine model [{engine_flags}]: capacity on the mix {calls:.2f} calls/s, "
        f"{tokens:.0f} answer tokens/s"
    )
    print(f"oracle: {json.dumps(row)}")
    for r in data["rows"]:
        print(
            f"  {r['label']}: {r['useful_tokens']} useful tokens, "
            f"{r['useful_tokens'] / _num(row, 'useful_tokens'):.2f} of it"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replay is not None:
        return replay(args.replay, args.engine_flags)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        print(f"bench_vllm_mix: unknown arms {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    arms = [ARMS[a] for a in args.arms.split(",")]
    duration = args.duration or (20.0 if args.quick else 45.0)
    burst = args.burst if args.burst is not None else (4 if args.quick else 8)
    budgets = Budgets()
    params = engine_params(args.engine_flags)
    flags = {"count": args.count_flags, "cost": args.cost_flags, "cost2": args.cost2_flags}
    if args.cost2_label:
        arms = [
            dataclasses.replace(a, setup=dataclasses.replace(a.setup, label=args.cost2_label))
            if a.name == "presets-cost2"
            else a
            for a in arms
        ]
    if any(a.flags in ("cost", "cost2") for a in arms) and "--max-inflight-tokens" in args.cost_flags:
        probe = cli_command("serve", "--help")
        import subprocess

        if "--max-inflight-tokens" not in subprocess.run(probe, capture_output=True, text=True).stdout:
            print("bench_vllm_mix: this shim has no --max-inflight-tokens; skipping presets-cost", flush=True)
            arms = [a for a in arms if a.flags not in ("cost", "cost2")]
    started = time.monotonic()
    pinned = LOAD_CPU in os.sched_getaffinity(0) and len(os.sched_getaffinity(0)) >= 2
    if pinned:
        os.sched_setaffinity(0, {LOAD_CPU})
    rows: list[Row] = []
    results: list[RunResult] = []
    measured: dict[str, dict[str, float]] = {}
    try:
        with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
            if args.engine_url:
                url = args.engine_url.rstrip("/")
            else:
                ensure_setup(DEFAULT_ENV, DEFAULT_MODEL)
                print("starting vllm serve (about 25 s) ...", flush=True)
                engine = stack.enter_context(
                    vllm_server(
                        slots=SLOTS,
                        cpu=ENGINE_CPU if pinned else None,
                        extra=("--max-model-len", str(MAX_MODEL_LEN)),
                    )
                )
                url = engine.url
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            mix = Mix(tokens_per_word=tokens_per_word(url, model))
            for only in ("chat", "long", None):
                name = only or "mix"
                model_calls, model_tokens = capacity(params, mix, only=only)
                workload = MixWorkload(mix, only)
                real = (
                    full_load_tokens_per_s(url, model, workload, slots=SLOTS, seconds=args.capacity_seconds)  # type: ignore[arg-type]
                    if args.capacity_seconds > 0
                    else math.nan
                )
                measured[name] = {"real_tokens_per_s": real, "model_tokens_per_s": model_tokens,
                                  "real_calls_per_s": real / workload.mean_answer_tokens(),
                                  "model_calls_per_s": model_calls}  # fmt: skip
                print(
                    f"all {SLOTS} slots busy, {name}: vLLM {real:.0f} answer tokens/s, the engine model "
                    f"{model_tokens:.0f} ({real / model_tokens:.2f})",
                    flush=True,
                )
            calls_per_s, tokens_per_s = (
                measured["mix"]["model_calls_per_s"],
                measured["mix"]["model_tokens_per_s"],
            )
            if args.capacity_seconds > 0:
                calls_per_s = measured["mix"]["real_calls_per_s"]
                tokens_per_s = measured["mix"]["real_tokens_per_s"]
            if args.capacity_calls_per_s:
                calls_per_s = args.capacity_calls_per_s
            rate = args.rate_factor * calls_per_s
            trace = mix_trace(
                mix, args.seed, rate=rate, duration=duration, burst=burst, burst_at=duration / 3
            )
            oracle_row = oracle_row_of(trace, params, budgets)
            # The fitted model is not this run's vLLM (the shared machine's speed moves from run
            # to run): the oracle again on the model at the speed vLLM showed on the mix here.
            fast_row: dict[str, object] | None = None
            if args.capacity_seconds > 0 or args.capacity_calls_per_s:
                engine_calls = (
                    measured["mix"]["real_calls_per_s"] if args.capacity_seconds > 0 else calls_per_s
                )
                speed = engine_calls / measured["mix"]["model_calls_per_s"]
                fast_row = {**oracle_row_of(trace, at_speed(params, speed), budgets), "speed": speed}
            longs = sum(c.kind == "long" for c in trace)
            print(
                f"vLLM at {url}; tokenizer {mix.tokens_per_word:.2f} tokens per word; engine model "
                f"[{args.engine_flags}]: capacity on the mix {calls_per_s:.2f} calls/s ({tokens_per_s:.0f} "
                f"answer tokens/s)\ntrace: {len(trace)} calls ({longs} long-prompt, {burst} of them in a "
                f"burst at "
                f"{duration / 3:.0f} s) at {rate:.2f}/s for {duration:.0f} s, seed {args.seed}\noracle: "
                f"{oracle_row['useful_tokens']} useful tokens, chat "
                f"{oracle_row['chat_served']}/{oracle_row['chat_offered']}, "
                f"long {oracle_row['long_served']}/{oracle_row['long_offered']}"
                + (
                    ""
                    if fast_row is None
                    else f"; at vLLM's speed (x{_num(fast_row, 'speed'):.2f}, calls/s measured over "
                    f"the model's): {fast_row['useful_tokens']} useful tokens, chat "
                    f"{fast_row['chat_served']}/{fast_row['chat_offered']}, "
                    f"long {fast_row['long_served']}/{fast_row['long_offered']}"
                ),
                flush=True,
            )
            scen = Scenario(
                "real-vllm-mix",
                burst=0,
                rate_factor=args.rate_factor,
                duration=duration,
                deadline=budgets.chat_deadline,
                ttft_budget=budgets.chat_ttft,
                interactive_share=1 - mix.long_share,
                start_deadline=False,
                batch_deadline=budgets.long_deadline,
            )
            for arm in arms:
                row, result = run_arm(
                    arm,
                    scen,
                    trace,
                    args.seed,
                    url,
                    model,
                    flags,
                    calls_per_s,
                    int(oracle_row["useful_tokens"]),  # type: ignore[call-overload]
                    budgets,
                    {"cost2": args.cost2_python} if args.cost2_python else {},
                )
                rows.append(row)
                results.append(result)
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130
    except (ServerStartError, RuntimeError) as exc:
        print(f"bench_vllm_mix: {exc}", file=sys.stderr)
        return 1
    table = markdown(rows, oracle_row, fast_row)
    head = (
        f"real vLLM (CPU, 8 slots, max-model-len {MAX_MODEL_LEN}); the mix at {args.rate_factor:g}x "
        f"({rate:.2f} calls/s for {duration:.0f} s, burst of {burst} long prompts at {duration / 3:.0f} s), "
        f"seed {args.seed}; count cap [{args.count_flags}]; cost cap [{args.cost_flags}]; oracle on "
        f"[{args.engine_flags}]"
    )
    print("\n" + head + "\n\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    png = args.out / f"{args.name}{suffix}.png"
    plot(rows, results, trace, png, head)
    (args.out / f"{args.name}{suffix}.md").write_text(head + "\n\n" + table + "\n")
    (args.out / f"{args.name}{suffix}.json").write_text(
        json.dumps(
            {
                "head": head,
                "rows": [dataclasses.asdict(r) for r in rows],
                "oracle": oracle_row,
                "oracle_at_vllm_speed": fast_row,
                "capacity": measured,
                "trace": {
                    "seed": args.seed,
                    "tokens_per_word": mix.tokens_per_word,
                    "rate": rate,
                    "duration": duration,
                    "burst": burst,
                    "engine_flags": args.engine_flags,
                },
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    print(f"\nplot: {png}\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
