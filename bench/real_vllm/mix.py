"""The long-prompt mix: its trace, and the simulator's engine model playing capacity and the oracle.

:func:`mix_trace`: chat calls (interactive: short prompts, lognormal answers) and long-prompt
calls (batch: 1.5-3k prompt tokens, short answers), Poisson at ``rate`` in the proportion
``long_share``, plus ``burst`` calls at ``burst_at``; seeded, so every configuration plays the
same calls. A mix of a named workload (:mod:`llm_backoff_shim.lab.workloads`) draws each kind's
lengths from it instead (chat: its interactive class, long: its batch class) and its interactive
arrivals follow its phases.

On :class:`~llm_backoff_shim.sim.engine.SimEngine` in virtual time: :func:`capacity` (every slot
busy, closed loop: the "1x" of the load) and :func:`oracle` (earliest latest-useful start first,
dropping and aborting what can no longer be useful; greedy EDF, so a reference, not a proof of the
maximum).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from llm_backoff_shim.lab.scenario import Scenario
from llm_backoff_shim.lab.workload import LengthDist, Workload, prompt_text
from llm_backoff_shim.lab.workloads import NamedWorkload
from llm_backoff_shim.sim.engine import EngineParams, SeqState, Sequence, SimEngine

Kind = Literal["chat", "long"]

CHAT_PROMPT_WORDS = LengthDist.lognormal(40, 0.9, 5, 200)
CHAT_ANSWER_TOKENS = LengthDist.lognormal(64, 0.8, 1, 512)
LONG_PROMPT_TOKENS = LengthDist.uniform(1500, 3000)
LONG_ANSWER_TOKENS = LengthDist.lognormal(64, 0.5, 16, 256)
#: Tokens a chat template adds around one user message (the simulator counts 4).
TEMPLATE_TOKENS = 8


@dataclass(frozen=True)
class Budgets:
    """What makes a call useful: chat's first token within ``chat_ttft`` and end within
    ``chat_deadline``; a long-prompt call's end within ``long_deadline``."""

    chat_ttft: float = 5.0
    chat_deadline: float = 20.0
    long_deadline: float = 60.0

    def deadline(self, kind: Kind) -> float:
        return self.chat_deadline if kind == "chat" else self.long_deadline


@dataclass(frozen=True)
class MixCall:
    index: int
    at: float
    kind: Kind
    prompt_words: int
    prompt_tokens: int
    max_tokens: int
    burst: bool = False
    #: The shared prefix's words and its group (the same words for every call of the group).
    prefix_words: int = 0
    prefix_group: int = 0

    def prompt(self, rng: random.Random) -> str:
        own = prompt_text(self.prompt_words, rng)
        if not self.prefix_words:
            return own
        return prompt_text(self.prefix_words, random.Random(f"prefix-{self.prefix_group}")) + " " + own


@dataclass(frozen=True)
class Mix:
    """The mix's shape; ``tokens_per_word``: the engine's tokenizer on the load generator's words.
    ``long_prompts`` False: the second kind (batch) has chat's lengths, short chat beside batch.
    ``workload``: the lengths of a named workload instead (module doc); ``long_prompts`` then says
    only whether its batch prompts are the longer, so the engine's prefill speed is fitted on them
    (the scoreboard's ``fit_speeds``)."""

    long_share: float = 0.2
    tokens_per_word: float = 1.45
    long_prompts: bool = True
    workload: NamedWorkload | None = None

    def draw(self, index: int, at: float, kind: Kind, rng: random.Random, *, burst: bool = False) -> MixCall:
        if self.workload is not None:
            lengths = self.workload.lengths("interactive" if kind == "chat" else "batch")
            words = max(1, round(lengths.prompt_tokens.draw(rng) / self.tokens_per_word))
            prefix = round(lengths.prefix_tokens / self.tokens_per_word)
            group = rng.randrange(lengths.prefix_groups) if lengths.prefix_groups else 0
            tokens = round((prefix + words) * self.tokens_per_word) + TEMPLATE_TOKENS
            answer = lengths.answer_tokens.draw(rng)
            return MixCall(index, at, kind, words, tokens, answer, burst, prefix, group)
        if kind == "chat" or not self.long_prompts:
            words = CHAT_PROMPT_WORDS.draw(rng)
            answer = CHAT_ANSWER_TOKENS.draw(rng)
        else:
            target = LONG_PROMPT_TOKENS.draw(rng)
            words = max(1, round((target - TEMPLATE_TOKENS) / self.tokens_per_word))
            answer = LONG_ANSWER_TOKENS.draw(rng)
        tokens = round(words * self.tokens_per_word) + TEMPLATE_TOKENS
        return MixCall(index, at, kind, words, tokens, answer, burst)

    def kind(self, rng: random.Random) -> Kind:
        return "long" if rng.random() < self.long_share else "chat"

    def answers(self, kind: Kind) -> LengthDist:
        if self.workload is not None:
            return self.workload.lengths("interactive" if kind == "chat" else "batch").answer_tokens
        return LONG_ANSWER_TOKENS if kind == "long" and self.long_prompts else CHAT_ANSWER_TOKENS

    def mean_answer_tokens(self) -> float:
        chat, long = self.answers("chat"), self.answers("long")
        if chat == long:
            return chat.mean()
        return (1 - self.long_share) * chat.mean() + self.long_share * long.mean()


@dataclass(frozen=True)
class MixWorkload:
    """The mix as :mod:`real_vllm.capacity`'s closed loop draws it (a ``Workload``'s ``draw``);
    ``only``: chat calls only, or long-prompt calls only."""

    mix: Mix
    only: Kind | None = None
    ignore_eos: bool = True

    def draw(self, rng: random.Random) -> tuple[str, int]:
        kind = self.only or self.mix.kind(rng)
        call = self.mix.draw(0, 0.0, kind, rng)
        return call.prompt(rng), call.max_tokens

    def mean_answer_tokens(self) -> float:
        if self.only is None:
            return self.mix.mean_answer_tokens()
        return self.mix.answers(self.only).mean()


def mix_trace(
    mix: Mix,
    seed: int,
    *,
    rate: float,
    duration: float,
    burst: int = 0,
    burst_at: float = 0.0,
    burst_kind: Kind | None = "long",
) -> list[MixCall]:
    """Poisson arrivals at ``rate`` /s for ``duration`` s; ``burst`` calls at ``burst_at``, each of
    ``burst_kind`` (None: drawn in the mix's proportion). A workload's phases: the long calls
    (batch) arrive steadily at their share of ``rate``, the chat calls at theirs times each
    phase's rate in its part of ``duration``."""
    rng = random.Random(seed)
    lengths = random.Random(rng.getrandbits(64))
    times: list[tuple[float, Kind, bool]] = []
    phases = mix.workload.phases if mix.workload is not None else None
    if phases is None or len(phases) == 1:
        t = rng.expovariate(rate)
        while t < duration:
            times.append((t, mix.kind(rng), False))
            t += rng.expovariate(rate)
    else:
        start = 0.0
        parts: list[tuple[Kind, float, float, float]] = [("long", 0.0, duration, rate * mix.long_share)]
        for p in phases:
            parts.append(("chat", start, start + p.share * duration, rate * (1 - mix.long_share) * p.rate))
            start += p.share * duration
        for kind, begin, end, per_s in parts:
            t = begin + (rng.expovariate(per_s) if per_s > 0 else end)
            while t < end:
                times.append((t, kind, False))
                t += rng.expovariate(per_s)
    times += [(burst_at, burst_kind or mix.kind(rng), True) for _ in range(burst)]
    times.sort(key=lambda x: x[0])
    return [mix.draw(i, at, kind, lengths, burst=b) for i, (at, kind, b) in enumerate(times)]


@dataclass
class Outcome:
    useful_tokens: int = 0
    served: dict[str, int] = field(default_factory=dict)
    offered: dict[str, int] = field(default_factory=dict)
    generated: int = 0
    chat_ttfts: list[float] = field(default_factory=list)


def capacity(
    params: EngineParams, mix: Mix, *, seconds: float = 600.0, seed: int = 0, only: Kind | None = None
) -> tuple[float, float]:
    """Calls/s and answer tokens/s with every slot busy on mix calls (closed loop, virtual time);
    ``only``: on chat calls only, or long-prompt calls only."""
    now = [0.0]
    engine = SimEngine(params, clock=lambda: now[0])
    rng = random.Random(seed)
    n = done_calls = done_tokens = 0

    def add() -> None:
        nonlocal n
        call = mix.draw(n, now[0], only or mix.kind(rng), rng)
        engine.add(str(n), max_tokens=call.max_tokens, prompt_tokens=call.prompt_tokens)
        n += 1

    for _ in range(params.max_num_seqs):
        add()
    warm = seconds * 0.1
    while now[0] < seconds:
        due = engine.next_event_time()
        assert due is not None
        now[0] = due
        for seq in engine.step():
            if seq.state is SeqState.FINISHED:
                if now[0] >= warm:
                    done_calls += 1
                    done_tokens += seq.generated
                add()
    span = seconds - warm
    return done_calls / span, done_tokens / span


def _estimate(params: EngineParams, call: MixCall) -> tuple[float, float]:
    """A call's time to first token and to its end with the engine full (the oracle's cost)."""
    first = params.ttft + call.prompt_tokens * params.prefill_time_per_token
    itl = params.itl * (1 + params.itl_batch_factor * (params.max_num_seqs - 1))
    return first, first + (call.max_tokens - 1) * itl


def oracle(calls: Iterable[MixCall], params: EngineParams, budgets: Budgets) -> Outcome:
    """Earliest-deadline-first in front of the engine model (module doc)."""
    pending = sorted(calls, key=lambda c: c.at)
    now = [0.0]
    engine = SimEngine(params, clock=lambda: now[0])
    out = Outcome()
    for c in pending:
        out.offered[c.kind] = out.offered.get(c.kind, 0) + 1
    ready: list[tuple[float, int, MixCall]] = []
    live: dict[str, tuple[MixCall, Sequence]] = {}
    i = 0
    while True:
        for seq in engine.step():
            if seq.state is not SeqState.FINISHED or seq.request_id not in live:
                continue
            c, _ = live.pop(seq.request_id)
            out.generated += seq.generated
            assert seq.first_token_at is not None
            assert seq.finished_at is not None
            ttft = seq.first_token_at - c.at
            useful = seq.finished_at - c.at <= budgets.deadline(c.kind)
            if c.kind == "chat":
                out.chat_ttfts.append(ttft)
                useful = useful and ttft <= budgets.chat_ttft
            if useful:
                out.useful_tokens += seq.generated
                out.served[c.kind] = out.served.get(c.kind, 0) + 1
        while i < len(pending) and pending[i].at <= now[0]:
            c = pending[i]
            first, end = _estimate(params, c)
            latest = c.at + budgets.deadline(c.kind) - end
            if c.kind == "chat":
                latest = min(latest, c.at + budgets.chat_ttft - first)
            heapq.heappush(ready, (latest, c.index, c))
            i += 1
        while ready and engine.num_running + engine.num_waiting < params.max_num_seqs:
            latest, _, c = heapq.heappop(ready)
            if latest >= now[0]:  # else it can no longer be useful: never started
                seq = engine.add(str(c.index), max_tokens=c.max_tokens, prompt_tokens=c.prompt_tokens)
                live[seq.request_id] = (c, seq)
        for key, (c, seq) in list(live.items()):  # abort what can no longer be useful
            late_first = c.kind == "chat" and seq.first_token_at is None and now[0] > c.at + budgets.chat_ttft
            if late_first or now[0] > c.at + budgets.deadline(c.kind):
                engine.abort(key)
                out.generated += seq.generated
                del live[key]
        due = [t for t in (engine.next_event_time(),) if t is not None]
        if i < len(pending):
            due.append(pending[i].at)
        for c, seq in live.values():  # when a live call would become useless
            due.append(c.at + budgets.deadline(c.kind) + 1e-6)
            if c.kind == "chat" and seq.first_token_at is None:
                due.append(c.at + budgets.chat_ttft + 1e-6)
        due = [t for t in due if t >= now[0]]
        if not due:
            return out
        now[0] = min(due)


def chat_scenario(duration: float, rate_factor: float) -> Scenario:
    """Short chat beside batch as the load generator's :class:`Scenario` (the fleet benchmark's
    load): Poisson at ``rate_factor`` x capacity for ``duration`` s, the default workload."""
    return Scenario(
        "real-vllm",
        burst=0,
        rate_factor=rate_factor,
        duration=duration,
        deadline=20.0,
        ttft_budget=5.0,
        interactive_share=0.7,
        workload=Workload(),
    )
