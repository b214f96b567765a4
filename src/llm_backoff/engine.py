"""The retrying HTTP transport: the seam where the policy meets the wire.

httpx and httpx2 layer a ``Client`` (auth, redirects, cookies, event hooks) over a
transport that turns one ``Request`` into one ``Response``. Retrying at that seam
means every request an openai client makes (chat, embeddings, responses, files,
pagination, streaming helpers) is covered without touching the client or the
caller, and the caller's connection pool, TLS and proxy settings are reused as-is.

This module holds the one engine that all four transports share (`RetryEngine`:
sync and async loops over the pure `attempts.RetryState`). The transport classes
themselves are thin and live next to their HTTP library (``_httpx_transport``,
``_httpx2_transport``, which import this module and never the reverse) so that
neither library is imported unless it is used; `llm_backoff.transport` is where
users import them from.

Per attempt, the engine:

- reads the request body once (so it can be replayed; uploads are held in memory);
- asks the limiter (if any) for a permit, with the time left as its timeout;
- when a deadline is set, cuts the request's connect/read/write/pool timeouts to
  the time left and sends ``x-request-timeout-ms``: the time left in ms (>= 1), or
  the read timeout if that is shorter, since that is as long as we will wait for
  the server to start answering; async attempts also run under a hard bound at the
  deadline (`_attempt_bound`). With a start deadline, "the time left" is what is
  left of it until the answer's head arrives, and ``x-request-timeout-scope: start``
  says so; a body passed through unread then reads under the call's deadline again
  (`RetryEngine._begun`);
- on a retry, counts it in ``x-stainless-retry-count`` when the request carries that
  header (openai's attempt number: 0, 1, 2, ...), and redoes what the SDK's own retries
  redo per attempt: credential providers and ``request`` event hooks (`refresh`);
- buffers JSON bodies and error bodies inside the attempt, so a connection that
  drops half-way through a JSON answer counts as a failed attempt and is retried,
  and the error body can be read for hints and ``insufficient_quota``. Other bodies
  (server-sent events, audio, file downloads) are passed through unread: once such
  a response has started, a failure is the caller's to see and is never retried,
  so no output is ever duplicated; it carries the call's history (`StreamGuard`);
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
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from ._attempt_bound import AttemptBound
from ._reach import content_type as _content_type
from ._reach import set_header as _set_header
from .attempts import (
    ATTRIBUTE,
    EXTENSION_KEY,
    Decision,
    GiveUp,
    Retry,
    RetryState,
    describe_error,
    format_history,
)
from .classify import Verdict, classify_exception, classify_status, parse_error_body
from .errors import RateLimitTimeout
from .events import CallObservers, RetryEvent, RetryHook, RetryObservers
from .limits import CallLimiter, Permit, RetryBudgetLike
from .policy import RetryPolicy, check_request_class, default_policy
from .refresh import AttemptRefresh
from .refresh import current as current_refresh
from .retry_after import parse_hint
from .stats import ClientStats
from .testing import current_mode

#: Task.uncancel() (3.11+) is what tells our deadline from a cancellation from outside;
#: without it (Python 3.10) an anyio cancel scope bounds every attempt.
_ASYNCIO_BOUND = sys.version_info >= (3, 11)

__all__ = ["CALL_STARTED", "REASON_KEY", "RetryEngine", "StreamGuard", "annotate"]

logger = logging.getLogger("llm_backoff")

REASON_KEY = "llm_backoff.reason"
_TIMEOUT_KEYS = ("connect", "read", "write", "pool")
#: The verdict and decision of the usual successes, built once rather than on every call.
_SUCCESS = {
    status: (Verdict(False, f"status {status}"), GiveUp(f"status {status}"))
    for status in (200, 201, 202, 204)
}


def _debug_enabled() -> bool:
    return logger.isEnabledFor(logging.DEBUG)


#: The openai SDKs number their attempts in this header (0 on the first); see `RetryEngine._mark_retry`.
RETRY_COUNT_HEADER = "x-stainless-retry-count"

#: When the caller's call began (the wrapped client's ``request``), on the engine's clock.
#: The openai client does its own work before its transport sees the request (building and
#: validating it, its own awaits), and in a burst of calls from one process that work
#: interleaves: 200 concurrent calls reached the transport about 0.2 s after they began.
#: A deadline started at the transport would tell the server ``x-request-timeout-ms`` that
#: much longer than the caller has. The first call the transport begins takes the mark and
#: clears it, so openai's own retries (``max_retries`` set again on a derived client) each
#: start a fresh deadline, as documented in ``wrap``.
CALL_STARTED: ContextVar[float | None] = ContextVar("llm_backoff_call_started", default=None)

#: JSON bodies above this are not handed to ``permit.settle`` (they are not chat completions).
MAX_SETTLE_BODY = 8 * 1024 * 1024
#: How much of a server-sent-event stream ``permit.settle`` sees: the end, where ``usage`` is.
SSE_TAIL = 64 * 1024


class _Request(Protocol):
    method: str
    headers: MutableMapping[str, str]
    extensions: dict[str, Any]

    @property
    def url(self) -> object: ...

    @property
    def content(self) -> bytes: ...


class _Response(Protocol):
    status_code: int
    headers: MutableMapping[str, str]
    extensions: dict[str, Any]
    stream: Any

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Flavor:
    """What differs between httpx and httpx2: the classes of streams we hand back."""

    byte_stream: Callable[[bytes], Any]
    guarded_stream: Callable[[Any, StreamGuard], Any]


class TailRecorder:
    """Keeps the last `SSE_TAIL` bytes of a stream and settles the permit once, on close."""

    def __init__(self, permit: Permit, status: int) -> None:
        self._permit = permit
        self._status = status
        self._tail = bytearray()
        self._settled = False

    def feed(self, chunk: bytes) -> None:
        self._tail += chunk
        if len(self._tail) > 2 * SSE_TAIL:  # trim rarely: amortised O(1) per byte
            del self._tail[: len(self._tail) - SSE_TAIL]

    def settle(self) -> None:
        if not self._settled:
            self._settled = True
            _settle(self._permit, self._status, bytes(self._tail[-SSE_TAIL:]))


class StreamGuard:
    """Watches a response body we passed through unread (events, downloads) while it is read.

    An error while reading it (the connection drops mid-stream) is raised as it is, never
    retried (the caller may have used part of the output), but carries the call's attempt
    history and a note like any final error. With a limiter, ``recorder`` keeps the tail
    of an event stream for the permit.
    """

    __slots__ = ("_attempts", "_status", "recorder")

    def __init__(self, attempts: tuple[Any, ...], status: int, recorder: TailRecorder | None) -> None:
        self._attempts = attempts
        self._status = status
        self.recorder = recorder

    def broke(self, exc: BaseException) -> None:
        annotate(
            exc,
            self._attempts,
            f"the response (status {self._status}) broke off after it had started; "
            "not retried, so no output is duplicated",
        )

    def closed(self) -> None:
        if self.recorder is not None:
            self.recorder.settle()


def _settle(permit: Permit | None, status: int | None, body: bytes | None) -> None:
    if permit is None:
        return
    try:
        permit.settle(status=status, body=body)
    except Exception:
        # A limiter bug must not turn a finished call into a failure.
        logger.exception("llm_backoff: permit.settle raised")


def _media_type(response: _Response) -> str:
    return _content_type(response.headers).split(";", 1)[0].strip().lower()


def _is_json(response: _Response) -> bool:
    media = _media_type(response)
    return media == "application/json" or media.endswith("+json")


def _must_buffer(response: _Response) -> bool:
    return response.status_code >= 400 or _is_json(response)


def _decoded(response: _Response, raw: bytes) -> bytes | None:
    """The body after content-encoding (gzip, br...) is undone; None if it cannot be."""
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return raw
    try:
        scratch = type(response)(response.status_code, headers=response.headers, content=raw)  # type: ignore[call-arg]
        return bytes(scratch.read())  # type: ignore[attr-defined]
    except Exception:
        return None


def _deadline_error(
    request: Any, message: str = "the call's deadline passed while the response was still arriving"
) -> Exception:
    """The HTTP library's own ReadTimeout, so classification and openai treat it as any timeout."""
    library = sys.modules.get(type(request).__module__.split(".", 1)[0])
    error = getattr(library, "ReadTimeout", None)
    if isinstance(error, type) and issubclass(error, Exception):
        made: Exception = error(message, request=request)  # type: ignore[call-arg]
        return made
    return TimeoutError(message)


def _read_sync(
    stream: Any, expires: float | None = None, clock: Callable[[], float] = time.monotonic
) -> bytes:
    # Per-read timeouts alone let a body that trickles in (a byte just inside each read
    # timeout) stretch the call without end: the deadline is checked between chunks too.
    chunks: list[bytes] = []
    try:
        for chunk in stream:
            chunks.append(chunk)
            if expires is not None and clock() > expires:
                raise _DeadlinePassedError
        return b"".join(chunks)
    finally:
        stream.close()


class _DeadlinePassedError(Exception):
    pass


async def _buffer_async(response: Any, flavor: Flavor) -> bytes | None:
    """Read a body we must see (JSON, errors) inside the attempt; None for one passed through."""
    if response.status_code < 400 and not _is_json(response):
        return None
    stream = response.stream
    try:
        raw = b"".join([chunk async for chunk in stream])
    finally:
        await stream.aclose()
    # A stream of the kind we would build (a mock's, or one httpx buffered) replays the same
    # bytes already: building another costs a per-call allocation for nothing.
    if type(stream) is not flavor.byte_stream:
        response.stream = flavor.byte_stream(raw)
    return raw


async def _attempt_async(
    request: Any, send: Callable[[Any], Awaitable[Any]], flavor: Flavor
) -> tuple[Any, bytes | None]:
    response = await send(request)
    return response, await _buffer_async(response, flavor)


def _asyncio_task() -> Any:
    # What sniffio answers "asyncio" for, without its thread-local and context-variable
    # look-ups (a few us per attempt): trio has no running asyncio loop, so this raises.
    try:
        return _current_task()
    except RuntimeError:
        return None


def annotate(exc: BaseException, attempts: tuple[Any, ...], reason: str | None) -> None:
    """Put the attempt history on ``exc`` as an attribute and a note (once)."""
    if getattr(exc, ATTRIBUTE, None) is not None:
        return
    setattr(exc, ATTRIBUTE, attempts)
    exc._llm_backoff_reason = reason  # type: ignore[attr-defined]
    note = format_history(attempts, reason)
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)
    else:  # Python 3.10: no add_note; keep the attribute 3.11+ tracebacks print
        notes = list(getattr(exc, "__notes__", []))
        notes.append(note)
        exc.__notes__ = notes  # type: ignore[attr-defined]


class RetryEngine:
    """The policy, hooks, limits and clocks one transport applies to every request.

    Shareable across threads and tasks: per-call state lives in a fresh
    `RetryState`; the shared pieces (observers, limiter, budget) are thread-safe.
    ``stats`` counts what this engine did; ``watchers`` (stats first) see every call.
    ``clock``/``wall_clock``/``rng``/``sleep``/``async_sleep`` are injectable for tests.
    """

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        on_retry: RetryObservers | RetryHook | Iterable[RetryHook] | None = None,
        request_class: str | None = None,
        limiter: CallLimiter | None = None,
        budget: RetryBudgetLike | None = None,
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
        self.limiter = limiter
        self.budget = budget
        self.clock = clock
        self.wall_clock = wall_clock
        self.rng = rng if rng is not None else random.Random()
        self.sleep = sleep
        self.async_sleep = async_sleep
        self.stats = ClientStats()
        self.watchers = CallObservers([self.stats])
        self._budget_probe = _BudgetProbe(self)

    # -- per call ------------------------------------------------------------------

    def _begin_call(self, request: _Request) -> tuple[RetryState, bool, Any, AttemptRefresh | None]:
        policy = self.policy
        mode = current_mode()
        if mode is not None and mode.max_attempts is not None and mode.max_attempts < policy.max_attempts:
            policy = policy.model_copy(update={"max_attempts": mode.max_attempts})
        started_at = CALL_STARTED.get()
        if started_at is not None:
            CALL_STARTED.set(None)
        if self.budget is None:
            state = RetryState(policy, clock=self.clock, rng=self.rng, started_at=started_at)
        else:
            state = RetryState(
                policy, clock=self.clock, rng=self.rng, budget=self._budget_probe, started_at=started_at
            )
            self.budget.record_request()
        if self.request_class is not None and "x-request-class" not in request.headers:
            request.headers["x-request-class"] = self.request_class
        return state, mode is not None, request.extensions.get("timeout"), current_refresh()

    @staticmethod
    def _expiry(state: RetryState) -> float | None:
        return state.expires_at

    @staticmethod
    def _limiter_timeout(state: RetryState) -> float | None:
        left = state.time_to_start()
        return None if left is None else max(0.0, left)

    @staticmethod
    def _stamp(request: _Request, state: RetryState, base_timeout: Any) -> float | None:
        """Cut the timeouts to the time left to begin and send it; returns it (None without a deadline)."""
        left = state.time_to_start()
        if left is None:
            return None
        left = max(left, 0.001)
        if isinstance(base_timeout, dict):
            cut = {}
            for key, value in base_timeout.items():  # a plain loop: a comprehension is a function call
                cut[key] = left if value is None or value > left else value
        else:
            cut = dict.fromkeys(_TIMEOUT_KEYS, left)
        # httpx/httpx2 give every Request its own extensions dict: updating it is safe.
        request.extensions["timeout"] = cut
        # We stop waiting for the first byte after the read timeout: promising the server
        # more patience than that would let it queue work nobody will collect.
        patience = min(left, cut.get("read") or left)
        _set_header(request.headers, "x-request-timeout-ms", str(max(1, int(patience * 1000))))
        if state.start_bound:
            # The budget ends when the answer begins: the shim then counts only the time to a
            # stream's first token against it, not the whole answer.
            _set_header(request.headers, "x-request-timeout-scope", "start")
        return left

    @staticmethod
    def _begun(request: _Request, state: RetryState, base_timeout: Any) -> None:
        """An answer passed through unread has begun: its body reads now answer to the deadline.

        `_stamp` cut the read timeout to the start deadline, which must not cut a stream
        that has started. httpx and httpx2 hand our ``timeout`` dict to their connection,
        which looks up the read timeout when the body is first read, after we return.
        """
        cut = request.extensions.get("timeout")
        if not isinstance(cut, dict):
            return
        read = base_timeout.get("read") if isinstance(base_timeout, dict) else None
        left = state.time_left()
        if left is not None:
            left = max(left, 0.001)
            read = left if read is None or read > left else read
        cut["read"] = read

    @staticmethod
    def _bound_error(request: _Request, state: RetryState) -> Exception:
        """The error for an async attempt cut by its bound: the start deadline's or the deadline's."""
        if state.start_bound:
            return _deadline_error(request, "the call's start deadline passed before the answer began")
        return _deadline_error(request)

    @staticmethod
    def _mark_retry(request: _Request) -> None:
        """Before each retry: count it in ``x-stainless-retry-count``, as openai's own retries do.

        openai stamps the header with its retry number (0 on a first attempt, and always 0
        under `wrap`, which switches openai's retries off); each of our retries adds one,
        so attempts send 0, 1, 2, ... and a server can tell a returning caller from a new
        one. A request without the header (not from openai, or the caller omitted it)
        is left without it; a value that is not a number restarts the count at 1.
        """
        current = request.headers.get(RETRY_COUNT_HEADER)
        if current is None:
            return
        try:
            count = int(current) + 1
        except ValueError:
            count = 1
        request.headers[RETRY_COUNT_HEADER] = str(max(count, 1))

    def _on_error(self, state: RetryState, exc: Exception, started: float, request: _Request) -> Decision:
        verdict = classify_exception(state.policy, exc)
        decision = state.decide(verdict, attempt_started=started, error=describe_error(exc))
        self._report(state, decision, request, None)
        if isinstance(decision, GiveUp):
            annotate(exc, state.history, decision.reason)
        return decision

    def _on_response(
        self, state: RetryState, response: _Response, raw: bytes | None, started: float, request: _Request
    ) -> tuple[Decision, bytes | None]:
        status = response.status_code
        body: bytes | None = None
        hint: float | None = None
        if status < 400:
            known = _SUCCESS.get(status)
            if known is not None:  # the usual answer: nothing to classify, log or wait for
                done = known[1]
                if (
                    state.finished(known[0], done, attempt_started=started, status=status) > 1
                    or _debug_enabled()
                ):
                    self._report(state, done, request, None)
                return done, None
            verdict = Verdict(False, f"status {status}")
        else:
            body = _decoded(response, raw) if raw is not None else None
            data = parse_error_body(body)
            parsed = parse_hint(response.headers, data, wall_clock=self.wall_clock)
            hint = None if parsed is None else parsed.seconds
            verdict = classify_status(state.policy, status, response.headers, data)
        decision = state.decide(verdict, attempt_started=started, status=status, hint=hint)
        self._report(state, decision, request, hint)
        return decision, body

    def _report(self, state: RetryState, decision: Decision, request: _Request, hint: float | None) -> None:
        last = state.last
        if isinstance(decision, Retry):
            elapsed = state.elapsed()
            logger.info(
                "%s %s attempt %d failed (%s); retrying in %.3g s%s",
                request.method,
                request.url,
                last.number,
                decision.reason,
                decision.wait,
                "" if hint is None else f" (server hint {hint:.3g} s)",
            )
            event = RetryEvent(
                attempt=last.number,
                reason=decision.reason,
                wait=decision.wait,
                hint=hint,
                elapsed=elapsed,
                method=request.method,
                url=str(request.url),
            )
            self.observers.emit(event)
            self.watchers.retrying(event)
        elif last.number > 1 and (last.status is None or last.status >= 400):
            logger.info(
                "%s %s giving up after %d attempts: %s",
                request.method,
                request.url,
                last.number,
                decision.reason,
            )
        elif logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s %s attempt %d done: %s",
                request.method,
                request.url,
                last.number,
                decision.reason,
            )

    def _finish(
        self,
        response: _Response,
        raw: bytes | None,
        body: bytes | None,
        permit: Permit | None,
        state: RetryState,
        flavor: Flavor,
    ) -> None:
        history = state.history
        extensions = dict(response.extensions)
        extensions[EXTENSION_KEY] = history
        if state.final_reason is not None and response.status_code >= 400:
            extensions[REASON_KEY] = state.final_reason
        response.extensions = extensions
        if raw is not None:
            if permit is not None:
                if body is None:
                    body = _decoded(response, raw)
                _settle(
                    permit,
                    response.status_code,
                    body if body is not None and len(body) <= MAX_SETTLE_BODY else None,
                )
            return
        # Passed through unread (server-sent events, downloads): once it has started it is
        # never retried, but an error while it is read still gets the call's history.
        recorder: TailRecorder | None = None
        if permit is not None:
            if _media_type(response) != "text/event-stream":
                _settle(permit, response.status_code, None)
            elif getattr(response, "is_closed", False):  # built from bytes (mocks): already read
                _settle(permit, response.status_code, bytes(getattr(response, "content", b""))[-SSE_TAIL:])
            else:
                recorder = TailRecorder(permit, response.status_code)
        if not getattr(response, "is_closed", False):
            response.stream = flavor.guarded_stream(
                response.stream, StreamGuard(history, response.status_code, recorder)
            )

    # -- the two loops -------------------------------------------------------------

    def _ended(self, state: RetryState, outcome: BaseException) -> None:
        verdict = "failed" if isinstance(outcome, Exception) else "cancelled"
        self.watchers.call_ended(verdict, state.attempts_made)

    def run_sync(self, request: Any, send: Callable[[Any], Any], flavor: Flavor) -> Any:
        """Send ``request`` through ``send`` (the wrapped transport) under the policy."""
        state, instant, base_timeout, refresh = self._begin_call(request)
        try:
            request.read()
            while True:
                permit: Permit | None = None
                if self.limiter is not None:
                    permit = self._acquire_sync(request, state)
                self._stamp(request, state, base_timeout)
                started = self.clock()
                raw: bytes | None = None
                try:
                    response = send(request)
                    if _must_buffer(response):
                        try:
                            raw = _read_sync(response.stream, self._expiry(state), self.clock)
                        except _DeadlinePassedError:
                            raise _deadline_error(request) from None
                        response.stream = flavor.byte_stream(raw)
                except BaseException as exc:
                    _settle(permit, None, None)
                    if not isinstance(exc, Exception):
                        raise
                    decision: Decision = self._on_error(state, exc, started, request)
                    if isinstance(decision, GiveUp):
                        raise
                    if not instant:
                        self.sleep(decision.wait)
                    self._mark_retry(request)
                    if refresh is not None:
                        refresh.run(request)
                    continue
                decision, body = self._on_response(state, response, raw, started, request)
                if isinstance(decision, Retry):
                    _settle(permit, response.status_code, body)
                    response.close()
                    if not instant:
                        self.sleep(decision.wait)
                    self._mark_retry(request)
                    if refresh is not None:
                        refresh.run(request)
                    continue
                if raw is None and state.starts_by is not None:
                    self._begun(request, state, base_timeout)
                self._finish(response, raw, body, permit, state, flavor)
                break
        except BaseException as exc:
            self._ended(state, exc)
            raise
        self.watchers.call_ended("ok" if response.status_code < 400 else "failed", state.attempts_made)
        return response

    def _acquire_sync(self, request: Any, state: RetryState) -> Permit:
        assert self.limiter is not None
        asked = self.clock()
        try:
            permit = self.limiter.acquire_for(request, timeout=self._limiter_timeout(state))
        except RateLimitTimeout as exc:
            self.watchers.limiter_waited(self.clock() - asked, granted=False)
            annotate(exc, state.history, str(exc) or "rate limit wait would pass the deadline")
            raise
        self.watchers.limiter_waited(self.clock() - asked, granted=True)
        return permit

    async def run_async(self, request: Any, send: Callable[[Any], Awaitable[Any]], flavor: Flavor) -> Any:
        """The async twin of `run_sync`; keep the two in step.

        One coroutine for the whole call: on the usual path (asyncio, first attempt
        succeeds) no helper coroutine is created, as each costs a frame and an await.
        """
        state, instant, base_timeout, refresh = self._begin_call(request)
        try:
            await request.aread()
            while True:
                permit: Permit | None = None
                if self.limiter is not None:
                    permit = await self._acquire_async(request, state)
                left = self._stamp(request, state, base_timeout)
                started = self.clock()
                raw: bytes | None = None
                try:
                    # A hard bound on the attempt: per-operation timeouts alone let a response
                    # that trickles in stretch the call past its deadline.
                    task = _asyncio_task() if left is not None and _ASYNCIO_BOUND else None
                    if task is not None:
                        assert left is not None
                        bound = AttemptBound(task, task.get_loop().time() + left)
                        try:
                            response = await send(request)
                            raw = await _buffer_async(response, flavor)
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
                            raise self._bound_error(request, state)
                    elif left is None:
                        response, raw = await _attempt_async(request, send, flavor)
                    else:
                        with anyio.move_on_after(left) as scope:
                            response, raw = await _attempt_async(request, send, flavor)
                        if scope.cancelled_caught:
                            raise self._bound_error(request, state)
                except BaseException as exc:
                    _settle(permit, None, None)
                    if not isinstance(exc, Exception):
                        raise
                    decision: Decision = self._on_error(state, exc, started, request)
                    if isinstance(decision, GiveUp):
                        raise
                    if not instant:
                        await self.async_sleep(decision.wait)
                    self._mark_retry(request)
                    if refresh is not None:
                        await refresh.arun(request)
                    continue
                decision, body = self._on_response(state, response, raw, started, request)
                if isinstance(decision, Retry):
                    _settle(permit, response.status_code, body)
                    await response.aclose()
                    if not instant:
                        await self.async_sleep(decision.wait)
                    self._mark_retry(request)
                    if refresh is not None:
                        await refresh.arun(request)
                    continue
                if raw is None and state.starts_by is not None:
                    self._begun(request, state, base_timeout)
                self._finish(response, raw, body, permit, state, flavor)
                break
        except BaseException as exc:
            self._ended(state, exc)
            raise
        self.watchers.call_ended("ok" if response.status_code < 400 else "failed", state.attempts_made)
        return response

    async def _acquire_async(self, request: Any, state: RetryState) -> Permit:
        assert self.limiter is not None
        asked = self.clock()
        try:
            permit = await self.limiter.acquire_for_async(request, timeout=self._limiter_timeout(state))
        except RateLimitTimeout as exc:
            self.watchers.limiter_waited(self.clock() - asked, granted=False)
            annotate(exc, state.history, str(exc) or "rate limit wait would pass the deadline")
            raise
        self.watchers.limiter_waited(self.clock() - asked, granted=True)
        return permit


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
