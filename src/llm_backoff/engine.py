"""The retrying HTTP transport's engine: the seam where the policy meets the wire.

httpx and httpx2 layer a ``Client`` (auth, redirects, cookies, event hooks) over a
transport that turns one ``Request`` into one ``Response``. Retrying at that seam
means every request an openai client makes (chat, embeddings, responses, files,
pagination, streaming helpers) is covered without touching the client or the
caller, and the caller's connection pool, TLS and proxy settings are reused as-is.

`RetryEngine` is what all four transports share: the policy, hooks, limits and
clocks, and two thin loops, `RetryEngine.run_sync` and `RetryEngine.run_async`, that
step one call's `attempt_core.call_steps` and perform the I/O it asks for. Every
decision about a call is made in `attempt_core`; a loop only sends, reads, sleeps,
acquires and closes. The transport classes themselves are thin and live next to their
HTTP library (``_httpx_transport``, ``_httpx2_transport``, which import this module and
never the reverse) so that neither library is imported unless it is used;
`llm_backoff.transport` is where users import them from.

Per attempt, a call:

- reads the request body once (so it can be replayed; uploads are held in memory);
- asks the limiter (if any) for a permit, with the time left as its timeout;
- when a deadline is set, cuts the request's timeouts to the time left and tells the
  server (`attempt_request`); async attempts also run under a hard bound at that time
  (`_attempt_bound`, or an anyio cancel scope off asyncio or before Python 3.11);
- on a retry, counts it in ``x-stainless-retry-count`` and redoes what the SDK's own
  retries redo per attempt: credential providers and ``request`` event hooks (`refresh`);
- buffers JSON and error bodies inside the attempt, reads a 200 event stream up to its
  first content (`stream_start`: an error or a cut before it fails the attempt) and passes
  other bodies through unread (`bodies`);
- records an `attempts.Attempt`; on success or on giving up, the history goes into
  ``response.extensions["llm_backoff.attempts"]`` or onto the raised exception as
  ``exc.llm_backoff_attempts`` plus an exception note.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from asyncio import CancelledError
from asyncio import current_task as _current_task
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any

import anyio

from ._attempt_bound import AttemptBound
from .attempt_core import (
    CONTINUE_KEY,
    Acquire,
    Begin,
    Close,
    ReadBody,
    Send,
    Sleep,
    begin_call,
    call_steps,
    cut_error,
)
from .bodies import DeadlinePassedError, Flavor, buffer_async, deadline_error, must_buffer, read_sync
from .continuation import Continued, generation_of
from .events import CallObservers, RetryHook, RetryObservers
from .limits import CallLimiter, RetryBudgetLike
from .pacing import PacedLimiter, PacedPermit, ServerPacer
from .policy import RetryPolicy, check_request_class, default_policy
from .stats import ClientStats
from .stream_start import open_async, open_sync, opens_stream

__all__ = ["RetryEngine"]

logger = logging.getLogger("llm_backoff")

#: Task.uncancel() (3.11+) is what tells our deadline from a cancellation from outside;
#: without it (Python 3.10) an anyio cancel scope bounds every attempt.
_ASYNCIO_BOUND = sys.version_info >= (3, 11)


def _asyncio_task() -> Any:
    # What sniffio answers "asyncio" for, without its thread-local and context-variable
    # look-ups (a few us per attempt): trio has no running asyncio loop, so this raises.
    try:
        return _current_task()
    except RuntimeError:
        return None


class RetryEngine:
    """The policy, hooks, limits and clocks one transport applies to every request.

    Shareable across threads and tasks: per-call state lives in a fresh call of
    `attempt_core.call_steps`; the shared pieces (observers, limiter, budget) are
    thread-safe. ``follow_rate_headers`` paces sends by the server's stated budget
    (`pacing`; `wrap` turns it on by default). ``stats`` counts what this engine did;
    ``watchers`` (stats first) see
    every call. ``clock``/``wall_clock``/``rng``/``sleep``/``async_sleep`` are
    injectable for tests.
    """

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        on_retry: RetryObservers | RetryHook | Iterable[RetryHook] | None = None,
        request_class: str | None = None,
        limiter: CallLimiter | None = None,
        budget: RetryBudgetLike | None = None,
        follow_rate_headers: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        check_request_class(request_class)
        self.policy = policy if policy is not None else default_policy(request_class)
        self.observers: RetryObservers
        if isinstance(on_retry, RetryObservers):
            self.observers = on_retry
        elif on_retry is None:
            self.observers = RetryObservers()
        elif callable(on_retry):
            self.observers = RetryObservers([on_retry])
        else:
            self.observers = RetryObservers(on_retry)
        self.request_class = request_class
        #: The server's stated budget (`pacing`), None when ``follow_rate_headers`` is off.
        self.pacer = ServerPacer(clock=clock, wall_clock=wall_clock) if follow_rate_headers else None
        self.limiter: CallLimiter | None = (
            limiter if self.pacer is None else PacedLimiter(self.pacer, limiter, clock)
        )
        self.budget = budget
        self.clock = clock
        self.wall_clock = wall_clock
        self.rng = rng if rng is not None else random.Random()
        self.sleep = sleep
        self.async_sleep = async_sleep
        self.stats = ClientStats()
        self.watchers = CallObservers([self.stats])
        #: The budget as `attempts.RetryState` sees it: refusals are reported to the watchers.
        self.budget_probe = _BudgetProbe(self)

    def run_sync(
        self, request: Any, send: Callable[[Any], Any], flavor: Flavor, beginning: Begin = begin_call
    ) -> Any:
        """Send ``request`` through ``send`` (the wrapped transport) under the policy, as a call of
        its own or as ``beginning`` says (`attempt_core.call_steps`)."""
        steps = call_steps(self, request, flavor, beginning)
        permit: Any = None
        try:
            effect = next(steps)
            while True:
                try:
                    if isinstance(effect, Send):
                        sent = self.clock()
                        response = send(request)
                        if isinstance(permit, PacedPermit):
                            _observe(permit, response)
                        raw = None
                        if must_buffer(response):
                            try:
                                raw = read_sync(response.stream, effect.expires, self.clock)
                            except DeadlinePassedError:
                                raise deadline_error(request) from None
                            response.stream = flavor.byte_stream(raw)
                        elif opens_stream(response):
                            # Read to first content under ``left``, as the async loop bounds an attempt.
                            bound = None if effect.left is None else sent + effect.left
                            try:
                                response, raw = open_sync(
                                    request, response, effect.begin, bound, self.clock, flavor
                                )
                            except DeadlinePassedError:
                                raise cut_error(request, effect.start_bound) from None
                            self._offer_continuation(request, response, send, flavor)
                        result: Any = (response, raw)
                    elif isinstance(effect, ReadBody):
                        result = request.read()
                    elif isinstance(effect, Acquire):
                        assert self.limiter is not None
                        result = permit = self.limiter.acquire_for(request, timeout=effect.timeout)
                    elif isinstance(effect, Sleep):
                        self.sleep(effect.seconds)
                        result = None
                    elif isinstance(effect, Close):
                        result = effect.response.close()
                    else:
                        effect.refresh.run(request)
                        result = None
                except BaseException as exc:
                    effect = steps.throw(exc)
                else:
                    effect = steps.send(result)
        except StopIteration as done:
            return done.value

    async def run_async(
        self,
        request: Any,
        send: Callable[[Any], Awaitable[Any]],
        flavor: Flavor,
        beginning: Begin = begin_call,
    ) -> Any:
        """`run_sync`'s counterpart: the same steps, each performed by awaiting.

        One coroutine for the whole call: on the usual path (asyncio, first attempt
        succeeds) no helper coroutine is created, as each costs a frame and an await.
        """
        steps = call_steps(self, request, flavor, beginning)
        permit: Any = None
        try:
            effect = next(steps)
            while True:
                try:
                    if isinstance(effect, Send):
                        # A hard bound on the attempt: per-operation timeouts alone let a response
                        # that trickles in stretch the call past its deadline.
                        left = effect.left
                        task = _asyncio_task() if left is not None and _ASYNCIO_BOUND else None
                        if task is not None:
                            assert left is not None
                            bound = AttemptBound(task, task.get_loop().time() + left)
                            try:
                                response = await send(request)
                                raw = await buffer_async(response, flavor)
                                if raw is None and opens_stream(response):
                                    response, raw = await open_async(request, response, effect.begin, flavor)
                                    self._offer_continuation(request, response, send, flavor)
                            except CancelledError:
                                if not bound.expired():
                                    raise
                                response = None
                            except BaseException:
                                bound.expired()
                                raise
                            else:
                                bound.expired()  # an answer that made it is kept, as under asyncio.timeout
                            if response is None:
                                raise cut_error(request, effect.start_bound)
                        elif left is None:
                            response = await send(request)
                            raw = await buffer_async(response, flavor)
                            if raw is None and opens_stream(response):
                                response, raw = await open_async(request, response, effect.begin, flavor)
                                self._offer_continuation(request, response, send, flavor)
                        else:
                            with anyio.move_on_after(left) as scope:
                                response = await send(request)
                                raw = await buffer_async(response, flavor)
                                if raw is None and opens_stream(response):
                                    response, raw = await open_async(request, response, effect.begin, flavor)
                                    self._offer_continuation(request, response, send, flavor)
                            if scope.cancelled_caught:
                                raise cut_error(request, effect.start_bound)
                        if isinstance(permit, PacedPermit):
                            _observe(permit, response)
                        result: Any = (response, raw)
                    elif isinstance(effect, ReadBody):
                        result = await request.aread()
                    elif isinstance(effect, Acquire):
                        assert self.limiter is not None
                        permit = await self.limiter.acquire_for_async(request, timeout=effect.timeout)
                        result = permit
                    elif isinstance(effect, Sleep):
                        await self.async_sleep(effect.seconds)
                        result = None
                    elif isinstance(effect, Close):
                        result = await effect.response.aclose()
                    else:
                        await effect.refresh.arun(request)
                        result = None
                except BaseException as exc:
                    effect = steps.throw(exc)
                else:
                    effect = steps.send(result)
        except StopIteration as done:
            return done.value

    def _offer_continuation(
        self, request: Any, response: Any, send: Callable[[Any], Any], flavor: Flavor
    ) -> None:
        """A stream has begun: with `RetryPolicy.continue_cut_streams`, and when it is a generation
        that can be continued, hand the core what continues it (`attempt_core.CONTINUE_KEY`)."""
        if self.policy.continue_cut_streams and response.status_code == 200:
            generation = generation_of(request)
            if generation is not None:
                response.extensions[CONTINUE_KEY] = partial(
                    Continued, self, send, flavor, request, generation
                )


def _observe(permit: PacedPermit, response: Any) -> None:
    """Hand an answer's headers to the pacer, for the send ``permit`` was taken for."""
    headers = response.headers
    try:
        permit.observe(list(headers.keys()), headers.get)
    except Exception:  # a pacer bug must not fail a call the server answered
        logger.exception("llm_backoff: reading the server's rate-limit headers failed")


class _BudgetProbe:
    """The engine's retry budget as `RetryState` sees it: refusals are reported to the watchers."""

    __slots__ = ("_engine",)

    def __init__(self, engine: RetryEngine) -> None:
        self._engine = engine

    def record_request(self) -> None:
        budget = self._engine.budget
        if budget is not None:
            budget.record_request()

    def try_spend(self) -> bool:
        budget = self._engine.budget
        if budget is None or budget.try_spend():
            return True
        self._engine.watchers.budget_refused()
        return False
