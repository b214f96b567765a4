"""Drain rate, service time and waits: the estimates behind admission and Retry-After.

Pure; the clock is injected.

The hint answers "when would a retry find room?". Room appears as requests ahead of
the caller are admitted, i.e. at the rate slots free up. That rate is estimated from
capacity by Little's law, ``slots / EWMA(service time)``, not from completions per
second: after light traffic few completions were observed although every slot could
turn over quickly, so a completions/s estimate would understate the drain rate and
overstate the wait. Completions/s per class is still tracked, for the
``drain_rate_per_second`` metric.

The Retry-After hints built on these estimates are :mod:`llm_backoff_shim.decide.retry_after`'s;
they are spread over one timeline for all classes, and the returns promised are remembered per
class so that fresh arrivals' waits count them: :mod:`llm_backoff_shim.decide.promises`.

Time a request still needs once admitted (:meth:`DrainEstimator.expected_service`): the
admission decision refuses a caller whose remaining budget cannot cover the expected wait
plus this, since such a call would start on the engine only to be cut by its own deadline.
By default every caller needs the whole service time (EWMA of its class's, once measured:
chat and batch answers differ by an order of magnitude, and a batch call admitted on chat's
mean with less budget than its own answer takes is cut by its deadline): a caller whose budget is its
deadline for the whole call (``llm_backoff``'s is) and whose stream is cut by it was not
served, and the engine's tokens for it were wasted. With ``stream_served_at="first_token"``
a streaming caller needs only the EWMA of time to first body byte, its class's once measured
(measured on streaming requests only: a non-streaming body's first byte comes with its end;
beside long prompts, whose prefill alone takes seconds, a chat's first token takes a fraction
of that), for callers whose budget ends once tokens flow; a request that says so itself
(``x-request-timeout-scope: start``, as ``llm_backoff`` does for a caller with a start
deadline) gets that rule alone.
Neither rests on the prior: unmeasured means 0 s needed.

Token rate (:meth:`DrainEstimator.observe_tokens`): output tokens per second of one slot,
the EWMA of the tokens of completed requests over the EWMA of their service times (a ratio
of averages, so a short request's prefill does not swing it). It prices a request that says
how long its answer may be (``max_tokens``): :meth:`DrainEstimator.run_time` is the seconds
that answer is expected to hold a slot, used to lend a reserved slot only to a request that
gives it back in time (:mod:`llm_backoff_shim.decide.classes`). The tokens counted are the
answer's, as the relay counted them; where it could not, what the request asked for at most
(``max_tokens``: an answer that stopped earlier then makes the rate look faster than it is).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from llm_backoff_shim.decide.promises import PromiseTimeline

Clock = Callable[[], float]
#: When the requests holding a slot were admitted, ascending: per class, or all as one.
Admitted = Mapping[str, Sequence[float]] | Sequence[float]


@dataclass(frozen=True)
class EstimatorConfig:
    """Knobs of :class:`DrainEstimator`.

    ``initial_service_time`` is the prior used until the first completion is measured;
    ``service_time_alpha`` is the EWMA weight of each new sample; ``rate_window`` is the
    time constant (seconds) of the completions/s estimate; ``stream_served_at``: whether
    a streaming caller's budget must cover the whole service (``end``) or only the first
    token (see the module docstring); ``return_jitter``: how late, as a fraction of its
    hint, a caller may come back (clients add jitter above a hint: ``llm_backoff``'s
    ``retry_after_jitter`` is 0.2 by default), see :meth:`DrainEstimator.latest_return`.
    """

    retry_after_min: float = 1.0
    retry_after_max: float = 30.0
    initial_service_time: float = 1.0
    service_time_alpha: float = 0.2
    rate_window: float = 10.0
    stream_served_at: Literal["end", "first_token"] = "end"
    return_jitter: float = 0.2

    def __post_init__(self) -> None:
        if not (0 < self.retry_after_min <= self.retry_after_max):
            raise ValueError("need 0 < retry_after_min <= retry_after_max")
        if not self.initial_service_time > 0:
            raise ValueError("initial_service_time must be > 0")
        if not (0 < self.service_time_alpha <= 1):
            raise ValueError("service_time_alpha must be in (0, 1]")
        if not self.rate_window > 0:
            raise ValueError("rate_window must be > 0")
        if not 0 <= self.return_jitter <= 1:
            raise ValueError("return_jitter must be between 0 and 1")


def _ewma(average: float | None, sample: float, alpha: float) -> float:
    """``average`` moved ``alpha`` of the way to ``sample``; the first sample (None) starts it."""
    return sample if average is None else average + alpha * (sample - average)


class _DecayingRate:
    """Events per second with exponential forgetting (time constant ``tau``).

    Each event adds ``1 / tau`` and the sum decays by ``exp(-dt / tau)``: a steady
    stream of ``r`` events/s converges to ``r``.
    """

    __slots__ = ("_last", "_tau", "_value")

    def __init__(self, tau: float) -> None:
        self._tau = tau
        self._value = 0.0
        self._last: float | None = None

    def _decayed(self, now: float) -> float:
        if self._last is None:
            return 0.0
        return self._value * math.exp(-max(0.0, now - self._last) / self._tau)

    def add(self, now: float) -> None:
        self._value = self._decayed(now) + 1.0 / self._tau
        self._last = now

    def value(self, now: float) -> float:
        return self._decayed(now)


class DrainEstimator:
    """Service time, drain rate, waits and the promise timeline for the shim's classes."""

    def __init__(self, config: EstimatorConfig, clock: Clock) -> None:
        self._config = config
        self._clock = clock
        self._service_time = config.initial_service_time
        self._samples = 0
        self._first_byte = 0.0
        self._first_byte_samples = 0
        # EWMAs of a completion's tokens and seconds (token_rate is their ratio).
        self._tokens = 0.0
        self._token_seconds = 0.0
        self._token_samples = 0
        self._completions: dict[str, _DecayingRate] = {}
        # Per class: EWMA of its service times and of its streams' first bytes (what one of its
        # requests needs once admitted).
        self._class_service: dict[str, float] = {}
        self._class_first_byte: dict[str, float] = {}
        self._promises = PromiseTimeline(clock, config.retry_after_min)

    @property
    def config(self) -> EstimatorConfig:
        return self._config

    def now(self) -> float:
        return self._clock()

    @property
    def promises(self) -> PromiseTimeline:
        """The places the hints gave and the returns promised (one engine, one timeline)."""
        return self._promises

    @property
    def service_time(self) -> float:
        """EWMA of seconds from admission to completion (the prior until measured)."""
        return self._service_time

    @property
    def samples(self) -> int:
        """How many completions have been measured; 0 means estimates rest on the prior."""
        return self._samples

    def observe_completion(self, cls: str, service_time: float) -> None:
        """Record a request that held a slot for ``service_time`` seconds and finished normally."""
        now = self._clock()
        if math.isfinite(service_time) and service_time >= 0:
            alpha = self._config.service_time_alpha
            if self._samples == 0:
                # The prior is a guess: the first measurement replaces it outright.
                self._service_time = service_time
            else:
                self._service_time += alpha * (service_time - self._service_time)
            self._samples += 1
            self._class_service[cls] = _ewma(self._class_service.get(cls), service_time, alpha)
        self._rate(cls).add(now)

    def class_service_time(self, cls: str | None) -> float:
        """EWMA of ``cls``'s service times once one was measured, else :attr:`service_time`."""
        mine = None if cls is None else self._class_service.get(cls)
        return self._service_time if mine is None else mine

    def observe_first_byte(self, seconds: float, cls: str | None = None) -> None:
        """Record seconds from admission to a streaming response's first body byte (first token)
        of a request of ``cls``."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        if self._first_byte_samples == 0:
            self._first_byte = seconds
        else:
            self._first_byte += self._config.service_time_alpha * (seconds - self._first_byte)
        self._first_byte_samples += 1
        if cls is not None:
            alpha = self._config.service_time_alpha
            self._class_first_byte[cls] = _ewma(self._class_first_byte.get(cls), seconds, alpha)

    def observe_tokens(self, tokens: int, seconds: float) -> None:
        """Record a served request that generated ``tokens`` (or at most that) in ``seconds`` on its slot."""
        if tokens < 1 or not (math.isfinite(seconds) and seconds > 0):
            return
        if self._token_samples == 0:
            self._tokens, self._token_seconds = float(tokens), seconds
        else:
            alpha = self._config.service_time_alpha
            self._tokens += alpha * (tokens - self._tokens)
            self._token_seconds += alpha * (seconds - self._token_seconds)
        self._token_samples += 1

    @property
    def token_rate(self) -> float | None:
        """Output tokens per second of one slot (module docstring); None until one was measured."""
        return self._tokens / self._token_seconds if self._token_samples else None

    def run_time(self, max_tokens: int | None) -> float | None:
        """Seconds a request asking for at most ``max_tokens`` is expected to hold its slot;
        None when it does not say, or no token rate was measured yet."""
        rate = self.token_rate
        if max_tokens is None or rate is None:
            return None
        return max_tokens / rate

    @property
    def first_byte_time(self) -> float | None:
        """EWMA of a streaming request's time to first body byte; None until one was measured."""
        return self._first_byte if self._first_byte_samples else None

    def served_at_first_byte(self, stream: bool, to_start: bool = False) -> bool:
        """Whether a request is served once its first body byte comes (else at its end): a stream
        whose budget ends when the answer begins (``to_start``), or any stream with
        ``stream_served_at="first_token"``; a non-streaming answer begins at its end."""
        return stream and (to_start or self._config.stream_served_at == "first_token")

    def expected_service(self, stream: bool, to_start: bool = False, cls: str | None = None) -> float:
        """Seconds an admitted request needs before it has been served (see module docstring
        and :meth:`served_at_first_byte`): the service time of its class (``cls``) once
        measured, else of every class; to the first byte likewise (a chat's first token comes in a
        fraction of the time a long prompt's prefill takes).

        0 when nothing was measured yet, so no caller is refused on the cold-start prior.
        """
        if self.served_at_first_byte(stream, to_start):
            if not self._first_byte_samples:
                return 0.0
            mine = None if cls is None else self._class_first_byte.get(cls)
            return self._first_byte if mine is None else mine
        return self.class_service_time(cls) if self._samples else 0.0

    def completion_rate(self, cls: str) -> float:
        """Completions per second observed for ``cls`` (decaying average).

        Read-only, so a metrics thread may call it while the event loop records completions.
        """
        rate = self._completions.get(cls)
        return 0.0 if rate is None else rate.value(self._clock())

    def capacity_rate(self, slots: int, cls: str | None = None) -> float:
        """Slots freed per second when all ``slots`` are busy (Little's law), each turning over
        at ``cls``'s service time (:meth:`class_service_time`), or every class's when None."""
        # A zero EWMA (instant upstream) would make the rate infinite; 1 ms floors it.
        return max(1, slots) / max(self.class_service_time(cls), 1e-3)

    def expected_wait(
        self,
        ahead: int,
        slots: int,
        free_slots: int,
        *,
        promised_by: Iterable[str] = (),
        admitted: Admitted | None = None,
        turn_class: str | None = None,
    ) -> float:
        """Seconds until a request with ``ahead`` others queued before it gets a slot.

        ``promised_by``: classes whose callers, promised a return before this request would
        be served, are served before it (returning callers go ahead of fresh arrivals, and
        higher classes ahead of lower ones); each such promise costs one more slot.

        ``admitted``: when the requests in flight were admitted (clock times, ascending), per
        class; each is expected to end its class's service time later (a plain sequence: one
        service time for all). Each of the ``slots`` then frees at its own end, so the n-th
        slot to free is known, not averaged. Without it, slots free evenly at the drain rate,
        as if the requests in flight had started one after another; after a burst they started
        together and free together, and the even estimate was wrong by up to a service time:
        in the tail of a burst of 200, callers were refused on a wait of 2.06 s that was 1.45 s.
        By class, because one mean over every class is wrong for each: beside long-prompt batch
        calls the mean was several chat service times, and chats were refused at arrival on
        waits their queue never reached (served chats' first tokens came by 3.1 s, p90, against
        a 5 s budget, while 160-200 others were refused on the estimate).

        ``turn_class``: after its first end, a slot serves the requests queued ahead, so it
        turns over at their service time: ``turn_class``'s when they are all of that class
        (the highest class waiting), else the mean over every class.
        """
        needed = ahead + 1 - max(0, free_slots)
        if needed <= 0:
            return 0.0
        at = self.slot_times(slots, admitted, turn_class)
        wait = at(needed)
        classes = tuple(promised_by)
        if classes:
            now = self._clock()
            # Fixed point of wait = time of the (needed + promises due within wait)-th free
            # slot; it only grows, by at least one promise per round, and promises are few
            # (bounded by the clamp).
            for _ in range(10_000):
                longer = at(needed + self._promises.promised_within(classes, now, now + wait))
                if longer <= wait:
                    break
                wait = longer
        return wait

    def slot_times(
        self, slots: int, admitted: Admitted | None = None, turn_class: str | None = None
    ) -> Callable[[int], float]:
        """``at(n)``: seconds from now until the n-th slot (n >= 1) of ``slots`` frees; see
        :meth:`expected_wait` for ``admitted`` and ``turn_class``. Built once, it answers for
        any n as long as the clock, the service times and the requests in flight stay as they
        are: a walk of the queue asks it once per queued request instead of rebuilding it."""
        lanes = max(1, slots)
        if admitted is None:
            service = max(self._service_time, 1e-3)

            def at(n: int) -> float:
                return n * service / lanes

            return at
        turn = max(self.class_service_time(turn_class), 1e-3)
        now = self._clock()
        by_class = {"": admitted} if isinstance(admitted, Sequence) else admitted
        held = sum(len(times) for times in by_class.values())
        idle = lanes - min(held, lanes)

        def ends_of(cls: str, times: Sequence[float]) -> Iterator[float]:
            took = self.class_service_time(cls or None)
            return (max(0.0, t + took - now) for t in times)

        # The first frees are the lanes nobody holds (now), then the soonest ends; a class's
        # times are ascending, so are its ends, and a lazy merge computes only the lanes asked
        # for, not every request in flight. Each slot freed serves the next request ahead and
        # frees again a turn later: those times come in the order they were made, so the n-th
        # free is the merge of two ascending streams (with one service time for all, this is
        # lane by lane in turn; with ends by class, a lane held by a long call is not waited
        # for while the short lanes turn over).
        ends = heapq.merge(*(ends_of(cls, times) for cls, times in by_class.items()))
        first: Iterator[float] = itertools.chain(
            itertools.repeat(0.0, idle), itertools.islice(ends, lanes - idle)
        )
        next_first = next(first, None)
        again: deque[float] = deque()
        known: list[float] = []

        def at_free(n: int) -> float:
            nonlocal next_first
            while len(known) < n:
                if next_first is not None and (not again or next_first <= again[0]):
                    freed, next_first = next_first, next(first, None)
                else:
                    freed = again.popleft()
                known.append(freed)
                again.append(freed + turn)
            return known[n - 1]

        return at_free

    def aim(self, delay: float) -> float:
        """The hint that brings a caller back, on average, ``delay`` seconds from now.

        Clients add up to ``return_jitter`` of a hint above it, ``return_jitter / 2`` on
        average; a caller told the slot itself comes back that much later on average, and
        on a timeline paced at the drain rate the engine then idles while it is on its way
        (measured in a burst of 200 with a 30 s deadline).
        """
        return delay / (1.0 + self._config.return_jitter / 2.0)

    def latest_return(self, hint: float) -> float:
        """Seconds from now by which a caller told ``hint`` is back, at the latest.

        A client that honours a hint adds its jitter above it, so a caller told ``hint``
        comes back up to ``return_jitter * hint`` later: whether its budget will still
        cover the service when it comes back is judged at this time, not at the hint
        (measured under 2x overload with a 10 s deadline: callers told 8.2 s came back
        0.6-1.4 s late and were refused with 0.4-0.7 s of budget left).
        """
        return hint * (1.0 + self._config.return_jitter)

    def _rate(self, cls: str) -> _DecayingRate:
        rate = self._completions.get(cls)
        if rate is None:
            rate = self._completions[cls] = _DecayingRate(self._config.rate_window)
        return rate
