# Over ~400 lines on purpose: one model (sequences, engine steps, KV cache, preemption) whose parts
# change together; some 45 of its lines are the model stated below.
"""The simulator's scheduler model: a vLLM-like continuous-batching engine, without I/O.

One :class:`SimEngine` holds a FIFO of waiting sequences and a set of running ones
(at most ``max_num_seqs``; the rest wait, unbounded unless ``max_num_queued_reqs`` is
set). The running ones advance together in *engine steps*, as vLLM's scheduler does:

- A step carries one decode token for every sequence past its prefill, then prompt
  tokens of sequences still in prefill (chunked prefill, oldest first) up to
  ``max_num_batched_tokens`` tokens in all. It lasts
  ``itl * (1 + itl_batch_factor * (decoding - 1))`` (0 without a decode), plus
  ``decode_attention_time`` per 1000 tokens in the decoding sequences' KV cache (attention
  reads every sequence's whole context at each step), plus
  ``prefill_time_per_token`` per prompt token in it, plus ``prefill_attention_time`` per
  prompt token for each 1000 tokens of its sequence's context before it (attention: a
  prompt of ``P`` tokens costs ``P * prefill_time_per_token + prefill_attention_time *
  P**2 / 2000`` in all, so prefill grows faster than the prompt, as measured on vLLM): a
  long prompt arriving slows the decode steps it shares, as it does on a real engine. The
  step that carries a request's first prefill chunk also lasts ``admit_time`` longer: the
  server's own work per request (parsing, chat template, tokenizer and detokenizer set-up)
  where it shares the engine's CPU, as vLLM's CPU build does (0 models a GPU engine, whose
  server runs beside it).
- A sequence emits its first token ``ttft`` after its prompt is prefilled: ``ttft`` is
  the fixed part of time to first token (scheduling, sampling, detokenising, the HTTP
  path) that holds the slot without costing the batch step time. Alone, with a prompt of
  ``P`` tokens, the first token comes ``P * prefill_time_per_token + ttft`` after
  admission and one token follows every ``itl``: a request of ``n`` tokens holds its slot
  ``P * prefill_time_per_token + ttft + (n - 1) * itl``, the calibration of the flags
  ``--ttft``/``--itl``/``--prefill-time-per-token``.
- With ``kv_cache_tokens`` set, every running sequence holds its prompt plus the tokens
  generated so far in the KV cache. A waiting sequence is admitted only when its prompt
  fits (first come, first served: the head of the queue blocks the rest). When the
  decode tokens of the next step do not fit, the youngest running sequence is
  *preempted*, as vLLM does: it leaves the batch for the head of the waiting queue, loses
  its cache, and once readmitted recomputes its prompt and the tokens it had generated
  (a prefill of that length) before it generates again. A request whose prompt plus
  ``max_tokens`` could never fit is refused (:class:`PromptTooLongError`).

Time comes from an injected clock and nothing here sleeps: :meth:`SimEngine.step`
completes the step that is due (one per call, anchored: the next step starts when the
last one ended, so a late caller catches up without drifting) and emits the first
tokens due, and :meth:`SimEngine.next_event_time` says when to call it next. The
asyncio edge (``sim_runtime``) drives it with one loop for all sequences.

Choices where vLLM and a simulator differ, made for the users of a test double:

- ``max_num_queued_reqs`` counts *unfinished* requests (waiting + running), as vLLM's
  flag of that name does (``AsyncLLM.check_admission``): a request that would make
  the count exceed the limit is refused with :class:`QueueFullError`.
- The KV cache is counted in tokens, not blocks.
- First tokens due within ``tick_slack`` seconds, and a step ending within it, are
  handled in the same call, which lets the edge wake up once for timers a hair apart.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields


class QueueFullError(Exception):
    """The engine already holds ``max_num_queued_reqs`` unfinished requests."""


class PromptTooLongError(ValueError):
    """The prompt plus ``max_tokens`` can never fit the KV cache (vLLM answers 400)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int) -> None:
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in "
            "the completion). Please reduce the length of the messages or completion."
        )


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class AbortReason(enum.Enum):
    """Why a sequence left early; only client departures count as wasted work for the demo."""

    CLIENT_GONE = "client_gone"
    FAULT = "fault"


@dataclass(frozen=True)
class EngineParams:
    max_num_seqs: int = 8
    ttft: float = 0.2
    itl: float = 0.025
    itl_batch_factor: float = 0.05
    max_num_queued_reqs: int | None = None
    tick_slack: float = 0.0
    prefill_time_per_token: float = 0.0
    prefill_attention_time: float = 0.0
    admit_time: float = 0.0
    decode_attention_time: float = 0.0
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 1:
            raise ValueError("max_num_queued_reqs must be >= 1 or None")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2:
            raise ValueError("kv_cache_tokens must be >= 2 or None")
        for name in (
            "ttft",
            "itl",
            "itl_batch_factor",
            "tick_slack",
            "prefill_time_per_token",
            "prefill_attention_time",
            "admit_time",
            "decode_attention_time",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. ``generated`` only grows; the edge tracks what it sent.

    ``prefill_target`` is what must be in the KV cache before the next token: the prompt,
    or after a preemption the prompt plus the tokens generated before it.
    """

    request_id: str
    max_tokens: int
    prompt_tokens: int
    arrival: float
    finish_reason: str = "stop"
    state: SeqState = SeqState.WAITING
    generated: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    prefill_target: int = 0
    prefilled: int = 0
    kv_tokens: int = 0
    decoding: bool = False
    ready_at: float = math.inf
    """When the first token is due (its prompt prefilled, plus ``ttft``); inf until then."""
    available_at: float = 0.0
    """When it became schedulable (admission, or its last token): where an idle engine's
    next step starts from."""
    preemptions: int = 0
    order: int = 0
    admit_paid: bool = False
    """Whether a step has carried its ``admit_time`` (once per request, with its first prefill chunk)."""

    @property
    def done(self) -> bool:
        return self.state in (SeqState.FINISHED, SeqState.ABORTED)


@dataclass
class SimStats:
    """Counters the demo and benchmarks read (``GET /sim/stats``, ``sim_*`` metrics).

    The engine updates the request/token counters; the HTTP edge updates
    ``requests_received``, ``requests_invalid`` and the ``injected_*`` fault counters,
    and counts a client that leaves before reaching the engine in ``requests_aborted``.
    ``prompt_tokens`` counts prompts as received; ``prefill_tokens`` what was computed,
    recomputations after a preemption included.
    """

    requests_received: int = 0
    requests_invalid: int = 0
    requests_completed: int = 0
    requests_aborted: int = 0
    aborted_tokens: int = 0
    requests_rejected: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    engine_steps: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    injected_errors: int = 0
    injected_resets: int = 0
    injected_slow_first_byte: int = 0
    injected_stream_cuts: int = 0

    def reset(self, *, running: int, waiting: int) -> None:
        """Zero every counter; peaks restart from the current occupancy, not from zero."""
        for f in fields(self):
            setattr(self, f.name, 0)
        self.peak_running = running
        self.peak_waiting = waiting


@dataclass
class _Step:
    start: float
    end: float
    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]


@dataclass
class SimEngine:
    """Waiting FIFO + running batch advanced in engine steps, driven by an injected clock."""

    params: EngineParams
    clock: Callable[[], float]
    stats: SimStats = field(default_factory=SimStats)

    def __post_init__(self) -> None:
        self._waiting: deque[Sequence] = deque()
        self._running: dict[str, Sequence] = {}
        self._ids: set[str] = set()
        self._step: _Step | None = None
        self._free_at = -math.inf
        self._admitted = 0

    # -- occupancy ------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_tokens_used(self) -> int:
        return sum(seq.kv_tokens for seq in self._running.values())

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV cache in use (0..1); without ``kv_cache_tokens``, of batch slots."""
        budget = self.params.kv_cache_tokens
        if budget is None:
            return len(self._running) / self.params.max_num_seqs
        return min(1.0, self.kv_tokens_used / budget)

    def current_itl(self) -> float:
        """Inter-token latency at the current batch size (a decode step without prefill)."""
        running = max(1, len(self._running))
        return self.params.itl * (1.0 + self.params.itl_batch_factor * (running - 1))

    # -- transitions ----------------------------------------------------------------

    def add(
        self, request_id: str, *, max_tokens: int, prompt_tokens: int = 0, finish_reason: str = "stop"
    ) -> Sequence:
        """Queue a request (and admit it at once if a slot is free).

        ``finish_reason`` is what the sequence reports when it reaches ``max_tokens``:
        ``"length"`` when the caller's limit cut it, ``"stop"`` for a natural end.
        Raises :class:`QueueFullError` when ``max_num_queued_reqs`` would be exceeded and
        :class:`PromptTooLongError` when the request could never fit the KV cache.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        if request_id in self._ids:
            raise ValueError(f"duplicate request id {request_id!r}")
        budget = self.params.kv_cache_tokens
        if budget is not None and prompt_tokens + max_tokens > budget:
            raise PromptTooLongError(prompt_tokens, max_tokens, budget)
        limit = self.params.max_num_queued_reqs
        if limit is not None and len(self._waiting) + len(self._running) + 1 > limit:
            self.stats.requests_rejected += 1
            raise QueueFullError(request_id)
        now = self.clock()
        seq = Sequence(
            request_id=request_id,
            max_tokens=max_tokens,
            prompt_tokens=prompt_tokens,
            arrival=now,
            finish_reason=finish_reason,
            prefill_target=prompt_tokens,
        )
        self._ids.add(request_id)
        self._waiting.append(seq)
        self.stats.prompt_tokens += prompt_tokens
        self._schedule(now)
        return seq

    def abort(self, request_id: str, reason: AbortReason = AbortReason.CLIENT_GONE) -> Sequence | None:
        """Remove a waiting or running sequence and hand its slot to the next waiter.

        Returns the aborted sequence, or None when it is unknown or already finished.
        """
        if request_id not in self._ids:
            return None
        seq = self._running.pop(request_id, None)
        if seq is None:
            seq = next((s for s in self._waiting if s.request_id == request_id), None)
            if seq is None:  # pragma: no cover - _ids and the containers move together
                self._ids.discard(request_id)
                return None
            self._waiting.remove(seq)
        now = self.clock()
        self._ids.discard(request_id)
        self._drop_from_step(seq)
        seq.state = SeqState.ABORTED
        seq.finished_at = now
        seq.kv_tokens = 0
        if reason is AbortReason.CLIENT_GONE:
            self.stats.requests_aborted += 1
            self.stats.aborted_tokens += seq.generated
        self._schedule(now)
        return seq

    def step(self) -> list[Sequence]:
        """Complete the engine step that is due and emit the first tokens that are due.

        Returns the sequences that produced a token in this call (one each at most); the
        finished ones among them have ``state == FINISHED`` and have left the engine.
        """
        now = self.clock()
        horizon = now + self.params.tick_slack
        touched: list[Sequence] = []
        step = self._step
        if step is not None and step.end <= horizon:
            self._step = None
            self._free_at = step.end
            self.stats.engine_steps += 1
            for seq in step.decode:
                seq.generated += 1
                seq.kv_tokens += 1
                seq.available_at = step.end
                touched.append(seq)
            for seq, tokens in step.prefill:
                seq.admit_paid = True
                seq.prefilled += tokens
                seq.kv_tokens += tokens
                self.stats.prefill_tokens += tokens
                if seq.prefilled >= seq.prefill_target:
                    self._prefilled(seq, step.end)
        for seq in self._running.values():
            if not seq.decoding and seq.ready_at <= horizon:
                seq.decoding = True
                seq.generated += 1
                seq.kv_tokens += 1
                seq.first_token_at = now
                seq.available_at = seq.ready_at
                touched.append(seq)
        self.stats.tokens_generated += len(touched)
        for seq in touched:
            if seq.generated >= seq.max_tokens:
                del self._running[seq.request_id]
                self._ids.discard(seq.request_id)
                seq.state = SeqState.FINISHED
                seq.finished_at = now
                seq.kv_tokens = 0
                self.stats.requests_completed += 1
        self._schedule(now)
        return touched

    def next_event_time(self) -> float | None:
        """When :meth:`step` next has work (clock time), or None when nothing is running."""
        if not self._running:
            return None
        due = min((seq.ready_at for seq in self._running.values() if not seq.decoding), default=math.inf)
        if self._step is not None:
            due = min(due, self._step.end)
        return None if math.isinf(due) else due

    def reset_stats(self) -> None:
        self.stats.reset(running=len(self._running), waiting=len(self._waiting))

    # -- internals ------------------------------------------------------------------

    def _prefilled(self, seq: Sequence, at: float) -> None:
        if seq.first_token_at is None:
            seq.ready_at = at + self.params.ttft
        else:  # recomputed after a preemption: it goes on generating at the next step
            seq.decoding = True
            seq.available_at = at

    def _drop_from_step(self, seq: Sequence) -> None:
        step = self._step
        if step is None:
            return
        if seq in step.decode:
            step.decode.remove(seq)
        step.prefill = [(s, n) for s, n in step.prefill if s is not seq]

    def _schedule(self, now: float) -> None:
        self._admit(now)
        if self._step is None:
            self._plan(now)
        stats = self.stats
        stats.peak_running = max(stats.peak_running, len(self._running))
        stats.peak_waiting = max(stats.peak_waiting, len(self._waiting))

    def _admit(self, now: float) -> None:
        budget = self.params.kv_cache_tokens
        used = self.kv_tokens_used if budget is not None else 0
        while self._waiting and len(self._running) < self.params.max_num_seqs:
            seq = self._waiting[0]
            if budget is not None:
                # Room for its whole prompt (and recomputed tokens) and one more token.
                if used + seq.prefill_target + 1 > budget:
                    return
                used += seq.prefill_target
            self._waiting.popleft()
            seq.state = SeqState.RUNNING
            if seq.admitted_at is None:
                seq.admitted_at = now
            seq.available_at = now
            self._admitted += 1
            seq.order = self._admitted
            self._running[seq.request_id] = seq
            if seq.prefilled >= seq.prefill_target:
                self._prefilled(seq, now)

    def _plan(self, now: float) -> None:
        """Lay out the next step from the running batch (module doc), preempting if the KV cache is full."""
        decode = [seq for seq in self._running.values() if seq.decoding]
        budget = self.params.kv_cache_tokens
        if budget is not None:
            while decode and self.kv_tokens_used + len(decode) > budget:
                victim = self._preempt_youngest()
                if victim in decode:
                    decode.remove(victim)
        room = self.params.max_num_batched_tokens - len(decode)
        prefill: list[tuple[Sequence, int]] = []
        for seq in self._running.values():
            if room <= 0:
                break
            left = seq.prefill_target - seq.prefilled
            if left > 0:
                chunk = min(left, room)
                prefill.append((seq, chunk))
                room -= chunk
        if not decode and not prefill:
            return
        params = self.params
        duration = sum(self.prefill_cost(seq.prefilled, n) for seq, n in prefill)
        duration += params.admit_time * sum(not seq.admit_paid for seq, _ in prefill)
        if decode:
            duration += params.itl * (1.0 + params.itl_batch_factor * (len(decode) - 1))
            duration += params.decode_attention_time * sum(seq.kv_tokens for seq in decode) / 1000
        ready = min(seq.available_at for seq in (*decode, *(s for s, _ in prefill)))
        start = min(now, max(self._free_at, ready))
        self._step = _Step(start, start + duration, decode, prefill)

    def prefill_cost(self, context: int, tokens: int) -> float:
        """Step seconds to prefill ``tokens`` prompt tokens after ``context`` already in the cache."""
        attention = self.params.prefill_attention_time * tokens * (context + (tokens - 1) / 2) / 1000
        return self.params.prefill_time_per_token * tokens + attention

    def _preempt_youngest(self) -> Sequence:
        victim = max(self._running.values(), key=lambda seq: seq.order)
        del self._running[victim.request_id]
        victim.state = SeqState.WAITING
        victim.decoding = False
        victim.ready_at = math.inf
        victim.kv_tokens = 0
        victim.prefilled = 0
        victim.prefill_target = victim.prompt_tokens + victim.generated
        victim.preemptions += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(victim)
        return victim
