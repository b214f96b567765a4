"""The asyncio edge of the simulator engine: one loop task ticks every sequence.

Handlers :meth:`SimRuntime.submit` a request and get a :class:`Ticket`; they await
:meth:`Ticket.wait` and read ``ticket.seq.generated`` to see how far generation got.
The loop sleeps until the engine's next token is due (one ``call_later`` timer for all
sequences) or until a submit/release changes the schedule, then steps the engine and
wakes the tickets that moved: streaming ones on every token, the others on finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from .config import SimConfig
from .engine import AbortReason, Sequence, SimEngine, SimStats
from .metrics import SimMetrics
from .protocol import GenerationRequest, TokenTable

logger = logging.getLogger(__name__)

# Tokens due within this many seconds share one wake-up of the loop.
TICK_SLACK = 0.001


class Ticket:
    """A handler's view of its sequence: a wake-up future plus failure flag."""

    __slots__ = ("_waiter", "failed", "seq", "stream")

    def __init__(self, seq: Sequence, stream: bool) -> None:
        self.seq = seq
        self.stream = stream
        self.failed = False
        self._waiter: asyncio.Future[None] | None = None

    def notify(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Sleep until :meth:`notify`. Check the state first: a notify before this call is not kept."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class SimRuntime:
    """Owns the engine, its stats, metrics and the loop task that drives it."""

    def __init__(
        self,
        config: SimConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng if rng is not None else random.Random(config.seed)
        # Apart from the fault draws, so lengths do not shift which requests get faults.
        self.length_rng = random.Random(None if config.seed is None else f"lengths:{config.seed}")
        self.stats = SimStats()
        self.engine = SimEngine(
            config.engine_params(tick_slack=TICK_SLACK),
            clock,
            self.stats,
        )
        self.metrics = SimMetrics(self.engine, config.model)
        self.tokens = TokenTable()
        self._tickets: dict[str, Ticket] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self.failure: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None or self._task.done():
            self.failure = None
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all()

    # -- handler API ----------------------------------------------------------------

    def natural_length(self) -> int:
        """The next request's natural answer length (``SimConfig.natural_length``)."""
        return self.config.natural_length(self.length_rng)

    def submit(self, request_id: str, request: GenerationRequest) -> Ticket:
        """Hand a request to the engine. Raises ``QueueFullError`` when it is refused and
        ``PromptTooLongError`` when it can never fit the KV cache."""
        self.start()
        seq = self.engine.add(
            request_id,
            max_tokens=request.max_tokens,
            prompt_tokens=request.prompt_tokens,
            finish_reason=request.finish_reason,
        )
        ticket = Ticket(seq, request.stream)
        if self.failure is not None:
            ticket.failed = True
        self._tickets[request_id] = ticket
        self._wake_loop()
        return ticket

    def release(self, ticket: Ticket, reason: AbortReason = AbortReason.CLIENT_GONE) -> None:
        """Forget a ticket; abort its sequence (freeing the slot) unless it already finished."""
        self._tickets.pop(ticket.seq.request_id, None)
        if not ticket.seq.done and self.engine.abort(ticket.seq.request_id, reason) is not None:
            self._wake_loop()

    @property
    def open_tickets(self) -> int:
        return len(self._tickets)

    # -- the loop -------------------------------------------------------------------

    def _wake_loop(self) -> None:
        if self._wake is not None:
            _resolve(self._wake)

    def _fail_all(self) -> None:
        for ticket in self._tickets.values():
            ticket.failed = True
            ticket.notify()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine, tickets, metrics = self.engine, self._tickets, self.metrics
        try:
            while True:
                for seq in engine.step():
                    metrics.observe_token(seq)
                    ticket = tickets.get(seq.request_id)
                    if ticket is None:
                        continue
                    if seq.done:
                        del tickets[seq.request_id]
                        ticket.notify()
                    elif ticket.stream:
                        ticket.notify()
                due = engine.next_event_time()
                handle: asyncio.TimerHandle | None = None
                if due is not None:
                    delay = due - self.clock()
                    if delay <= 0:
                        # Late: let handlers send what is ready, then catch up.
                        await asyncio.sleep(0)
                        continue
                wake: asyncio.Future[None] = loop.create_future()
                self._wake = wake
                if due is not None:
                    handle = loop.call_later(delay, _resolve, wake)
                try:
                    await wake
                finally:
                    self._wake = None
                    if handle is not None:
                        handle.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave handlers hanging
            logger.exception("simulator engine loop failed")
            self.failure = exc
            self._fail_all()
