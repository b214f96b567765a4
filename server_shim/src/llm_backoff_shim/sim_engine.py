"""The simulator's scheduler model: a vLLM-like continuous-batching engine, without I/O.

One :class:`SimEngine` holds a FIFO of waiting sequences and a set of running ones.
At most ``max_num_seqs`` run at once; the rest wait, unbounded unless
``max_num_queued_reqs`` is set. A sequence admitted at ``t`` emits its first token at
``t + ttft`` and each later token one inter-token latency after the previous one, the
latency growing with the batch: ``itl * (1 + itl_batch_factor * (running - 1))``.

Time comes from an injected clock and nothing here sleeps: :meth:`SimEngine.step`
emits whatever is due now and :meth:`SimEngine.next_event_time` says when to call it
next. The asyncio edge (``sim_runtime``) drives it with one loop for all sequences.

Choices where vLLM and a simulator differ, made for the users of a test double:

- ``max_num_queued_reqs`` counts *unfinished* requests (waiting + running), as vLLM's
  flag of that name does (``AsyncLLM.check_admission``): a request that would make
  the count exceed the limit is refused with :class:`QueueFullError`.
- Each running sequence emits at most one token per :meth:`step`; its schedule is
  anchored (``next_due += itl``), so a late caller catches up instead of drifting and
  the configured token rate holds on a busy machine.
- Tokens due within ``tick_slack`` seconds are emitted in the same step, which lets
  the edge wake up once for sequences whose timers are a hair apart.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields


class QueueFullError(Exception):
    """The engine already holds ``max_num_queued_reqs`` unfinished requests."""


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

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 1:
            raise ValueError("max_num_queued_reqs must be >= 1 or None")
        for name in ("ttft", "itl", "itl_batch_factor", "tick_slack"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. ``generated`` only grows; the edge tracks what it sent."""

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
    next_due: float = math.inf

    @property
    def done(self) -> bool:
        return self.state in (SeqState.FINISHED, SeqState.ABORTED)


@dataclass
class SimStats:
    """Counters the demo and benchmarks read (``GET /sim/stats``, ``sim_*`` metrics).

    The engine updates the request/token counters; the HTTP edge updates
    ``requests_received``, ``requests_invalid`` and the ``injected_*`` fault counters,
    and counts a client that leaves before reaching the engine in ``requests_aborted``.
    """

    requests_received: int = 0
    requests_invalid: int = 0
    requests_completed: int = 0
    requests_aborted: int = 0
    aborted_tokens: int = 0
    requests_rejected: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
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
class SimEngine:
    """Waiting FIFO + running set + per-sequence token schedule, driven by an injected clock."""

    params: EngineParams
    clock: Callable[[], float]
    stats: SimStats = field(default_factory=SimStats)

    def __post_init__(self) -> None:
        self._waiting: deque[Sequence] = deque()
        self._running: dict[str, Sequence] = {}
        self._ids: set[str] = set()

    # -- occupancy ------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of batch slots in use (0..1).

        The simulator has no memory model; batch occupancy moves the way a real KV cache
        gauge does under load, which is what dashboards and autoscalers look at.
        """
        return len(self._running) / self.params.max_num_seqs

    def current_itl(self) -> float:
        """Inter-token latency at the current batch size."""
        running = max(1, len(self._running))
        return self.params.itl * (1.0 + self.params.itl_batch_factor * (running - 1))

    # -- transitions ----------------------------------------------------------------

    def add(
        self, request_id: str, *, max_tokens: int, prompt_tokens: int = 0, finish_reason: str = "stop"
    ) -> Sequence:
        """Queue a request (and admit it at once if a slot is free).

        ``finish_reason`` is what the sequence reports when it reaches ``max_tokens``:
        ``"length"`` when the caller's limit cut it, ``"stop"`` for a natural end.
        Raises :class:`QueueFullError` when ``max_num_queued_reqs`` would be exceeded.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if request_id in self._ids:
            raise ValueError(f"duplicate request id {request_id!r}")
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
        )
        self._ids.add(request_id)
        self._waiting.append(seq)
        self.stats.prompt_tokens += prompt_tokens
        self._admit(now)
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
        seq.state = SeqState.ABORTED
        seq.finished_at = now
        seq.next_due = math.inf
        if reason is AbortReason.CLIENT_GONE:
            self.stats.requests_aborted += 1
            self.stats.aborted_tokens += seq.generated
        self._admit(now)
        return seq

    def step(self) -> list[Sequence]:
        """Emit every token due now (one per running sequence at most) and admit waiters.

        Returns the sequences that produced a token in this step; the finished ones among
        them have ``state == FINISHED`` and have left the engine.
        """
        now = self.clock()
        horizon = now + self.params.tick_slack
        itl = self.current_itl()
        touched: list[Sequence] = []
        finished: list[Sequence] = []
        for seq in self._running.values():
            if seq.next_due > horizon:
                continue
            seq.generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
            touched.append(seq)
            if seq.generated >= seq.max_tokens:
                finished.append(seq)
            else:
                seq.next_due += itl
        self.stats.tokens_generated += len(touched)
        for seq in finished:
            del self._running[seq.request_id]
            self._ids.discard(seq.request_id)
            seq.state = SeqState.FINISHED
            seq.finished_at = now
            seq.next_due = math.inf
            self.stats.requests_completed += 1
        self._admit(now)
        return touched

    def next_event_time(self) -> float | None:
        """When :meth:`step` next has work (clock time), or None when nothing is running."""
        if not self._running:
            return None
        return min(seq.next_due for seq in self._running.values())

    def reset_stats(self) -> None:
        self.stats.reset(running=len(self._running), waiting=len(self._waiting))

    # -- internals ------------------------------------------------------------------

    def _admit(self, now: float) -> None:
        while self._waiting and len(self._running) < self.params.max_num_seqs:
            seq = self._waiting.popleft()
            seq.state = SeqState.RUNNING
            seq.admitted_at = now
            seq.next_due = now + self.params.ttft
            self._running[seq.request_id] = seq
        stats = self.stats
        stats.peak_running = max(stats.peak_running, len(self._running))
        stats.peak_waiting = max(stats.peak_waiting, len(self._waiting))
