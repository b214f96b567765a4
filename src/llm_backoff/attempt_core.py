"""One call's retry loop, written once for sync and async: a generator of effects.

`call_steps` decides everything about a call (when to ask the limiter, what each
attempt's request carries, whether an outcome is retried and after how long, what is
logged, reported, settled and recorded) and performs no I/O. It yields an *effect*
for each piece of I/O and is resumed with its result:

=================  ==============================  ==========================================
effect             sync loop performs              resumed with
=================  ==============================  ==========================================
`ReadBody`         ``request.read()``              anything (ignored)
`Acquire`          ``limiter.acquire_for(...)``    the `Permit`
`Send`             one attempt, its body buffered  ``(response, raw body or None)``
                   when `bodies.must_buffer`, a
                   200 event stream read to its
                   first content (`stream_start`)
`Close`            ``response.close()``            anything (ignored)
`Sleep`            ``sleep(seconds)``              anything (ignored)
`Refresh`          ``refresh.run(request)``        anything (ignored)
=================  ==============================  ==========================================

The async loop performs the same effects with their awaitable twins. The contract
between the core and a loop:

- an exception raised while performing an effect is thrown into the generator at
  the ``yield`` that asked for it (``generator.throw``), never handled by the loop,
  so the core alone decides what a failure means, and sees every way a call ends;
- the generator's return value (``StopIteration.value``) is the response to hand
  back; an exception out of it is the call's error, already annotated;
- a `Send` carries what bounds the attempt: ``left``, the seconds the answer has to
  begin (the async loop's hard bound), ``expires``, the clock reading at which the
  deadline passes (checked between the chunks of a sync body), and ``start_bound``,
  which of the two a cut attempt missed (`cut_error`).

Only the clock (``engine.clock``) and the random source (through `attempts.RetryState`)
are read for decisions, so a test can step a call with a fake clock and no HTTP library.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from .attempt_request import AttemptRequest, begun, mark_retry, stamp
from .attempts import EXTENSION_KEY, REASON_KEY, Decision, GiveUp, Retry, RetryState, annotate, describe_error
from .bodies import (
    MAX_SETTLE_BODY,
    SSE_TAIL,
    AttemptResponse,
    Flavor,
    StreamGuard,
    TailRecorder,
    deadline_error,
    decoded,
    is_event_stream,
)
from .classify import Verdict, classify_exception, classify_status, parse_error_body
from .errors import RateLimitTimeout
from .events import RetryEvent
from .limits import Permit, settle_quietly
from .refresh import AttemptRefresh
from .refresh import current as current_refresh
from .retry_after import parse_hint
from .stream_start import STREAM_ERROR_KEY
from .testing import current_mode

if TYPE_CHECKING:
    from .engine import RetryEngine

__all__ = [
    "CALL_STARTED",
    "CONTINUE_KEY",
    "Acquire",
    "Begin",
    "Close",
    "Effect",
    "ReadBody",
    "Refresh",
    "Send",
    "Sleep",
    "begin_call",
    "call_steps",
    "continuing",
    "cut_error",
    "report",
]

logger = logging.getLogger("llm_backoff")

#: When the caller's call began (the wrapped client's ``request``), on the engine's clock.
#: The openai client does its own work before its transport sees the request (building and
#: validating it, its own awaits), and in a burst of calls from one process that work
#: interleaves: 200 concurrent calls reached the transport about 0.2 s after they began.
#: A deadline started at the transport would tell the server ``x-request-timeout-ms`` that
#: much longer than the caller has. The first call the transport begins takes the mark and
#: clears it, so openai's own retries (``max_retries`` set again on a derived client) each
#: start a fresh deadline, as documented in ``wrap``.
CALL_STARTED: ContextVar[float | None] = ContextVar("llm_backoff_call_started", default=None)

#: Key in ``response.extensions`` under which the engine's loop hands `_finish`, for a stream that
#: began, what continues it if it is cut after content (`continuation.Continued`, given the call's
#: state, the stream and the answer's extensions).
CONTINUE_KEY = "llm_backoff.continue"


class _PartOfACall:
    """The watchers as a continuation reports to them: it is part of a call already counted."""

    __slots__ = ("_watchers",)

    def __init__(self, watchers: Any) -> None:
        self._watchers = watchers

    def limiter_waited(self, seconds: float, *, granted: bool) -> None:
        self._watchers.limiter_waited(seconds, granted=granted)

    def call_ended(self, outcome: str, attempts: int) -> None:
        return None


#: The verdict and decision of the usual successes, built once rather than on every call.
_SUCCESS = {
    status: (Verdict(False, f"status {status}"), GiveUp(f"status {status}"))
    for status in (200, 201, 202, 204)
}


# -- the effects ---------------------------------------------------------------------


class ReadBody(NamedTuple):
    """Read the request body once, so that every attempt can replay it."""


class Acquire(NamedTuple):
    """Ask the limiter for a permit, waiting at most ``timeout`` seconds (None: no limit)."""

    timeout: float | None


class Send(NamedTuple):
    """Send one attempt, buffer its body when `bodies.must_buffer` says so, read a 200 event
    stream to its first content (`stream_start.open_sync`: an error event before it is the
    answer of the status it stands for, a cut before it an error)."""

    left: float | None
    """Seconds for the answer to begin, or None without a deadline: the async hard bound."""
    expires: float | None
    """The clock reading at which the call's deadline passes: checked between sync body chunks."""
    start_bound: bool
    """Whether ``left`` is the start deadline's rather than the deadline's (`cut_error`)."""
    begin: Callable[[], None] | None = None
    """With a start deadline: called once a 200 event stream's head has come, before its body
    is read to the first content, so that its reads answer to the deadline (`begun`)."""


class Close(NamedTuple):
    """Close a response that is retried (its body, if any, was read already)."""

    response: Any


class Sleep(NamedTuple):
    """Wait before the next attempt."""

    seconds: float


class Refresh(NamedTuple):
    """Redo what the SDK redoes per attempt (credentials, request hooks) on the request."""

    refresh: AttemptRefresh


Effect = ReadBody | Acquire | Send | Close | Sleep | Refresh

_READ_BODY = ReadBody()


def cut_error(request: Any, start_bound: bool) -> Exception:
    """The error of an attempt cut by its hard bound: the start deadline's or the deadline's."""
    if start_bound:
        return deadline_error(request, "the call's start deadline passed before the answer began")
    return deadline_error(request)


# -- one call ------------------------------------------------------------------------


#: How one call begins: its state, whether waits are skipped (testing mode), its base timeout,
#: its refresh, and the watchers it reports to (`begin_call`, or `continuing` a call).
Begin = Callable[["RetryEngine", AttemptRequest], "tuple[RetryState, bool, Any, AttemptRefresh | None, Any]"]


def begin_call(
    engine: RetryEngine, request: AttemptRequest
) -> tuple[RetryState, bool, Any, AttemptRefresh | None, Any]:
    """A call of its own: a fresh state, counted by the engine's watchers."""
    policy = engine.policy
    mode = current_mode()
    if mode is not None and mode.max_attempts is not None and mode.max_attempts < policy.max_attempts:
        policy = policy.model_copy(update={"max_attempts": mode.max_attempts})
    started_at = CALL_STARTED.get()
    if started_at is not None:
        CALL_STARTED.set(None)
    if engine.budget is None:
        state = RetryState(policy, clock=engine.clock, rng=engine.rng, started_at=started_at)
    else:
        state = RetryState(
            policy, clock=engine.clock, rng=engine.rng, budget=engine.budget_probe, started_at=started_at
        )
        engine.budget.record_request()
    if engine.request_class is not None and "x-request-class" not in request.headers:
        request.headers["x-request-class"] = engine.request_class
    return state, mode is not None, request.extensions.get("timeout"), current_refresh(), engine.watchers


def continuing(state: RetryState) -> Begin:
    """How the continuation of a call begins (a stream cut after content, `continuation`): its
    attempts, deadline and budget are that call's ``state``, and it is not a call of its own."""

    def begin(
        engine: RetryEngine, request: AttemptRequest
    ) -> tuple[RetryState, bool, Any, AttemptRefresh | None, Any]:
        instant = current_mode() is not None
        return state, instant, request.extensions.get("timeout"), None, _PartOfACall(engine.watchers)

    return begin


def call_steps(
    engine: RetryEngine, request: AttemptRequest, flavor: Flavor, beginning: Begin = begin_call
) -> Generator[Effect, Any, AttemptResponse]:
    """Drive one call through ``engine``'s policy: yields effects, returns the response to hand back.

    ``beginning``: a call of its own (`begin_call`), or the continuation of one (`continuing`).
    """
    state, instant, base_timeout, refresh, watchers = beginning(engine, request)
    clock = engine.clock
    limiter = engine.limiter
    try:
        yield _READ_BODY
        while True:
            permit: Permit | None = None
            if limiter is not None:
                asked = clock()
                left = state.time_to_start()
                try:
                    permit = yield Acquire(None if left is None else max(0.0, left))
                except RateLimitTimeout as exc:
                    watchers.limiter_waited(clock() - asked, granted=False)
                    annotate(exc, state.history, str(exc) or "rate limit wait would pass the deadline")
                    raise
                watchers.limiter_waited(clock() - asked, granted=True)
            left = stamp(request, state, base_timeout)
            started = clock()
            response: AttemptResponse
            raw: bytes | None
            try:
                begin = None if state.starts_by is None else partial(begun, request, state, base_timeout)
                response, raw = yield Send(left, state.expires_at, state.start_bound, begin)
            except BaseException as exc:
                settle_quietly(permit, None, None)
                if not isinstance(exc, Exception):
                    raise
                decision: Decision = _on_error(engine, state, exc, started, request)
                if isinstance(decision, GiveUp):
                    raise
            else:
                decision, body = _on_response(engine, state, response, raw, started, request)
                if not isinstance(decision, Retry):
                    if raw is None and state.starts_by is not None:
                        begun(request, state, base_timeout)
                    _finish(response, raw, body, permit, state, flavor)
                    break
                settle_quietly(permit, response.status_code, body)
                yield Close(response)
            if not instant:
                yield Sleep(decision.wait)
            mark_retry(request)
            if refresh is not None:
                yield Refresh(refresh)
    except BaseException as exc:
        watchers.call_ended("failed" if isinstance(exc, Exception) else "cancelled", state.attempts_made)
        raise
    watchers.call_ended("ok" if response.status_code < 400 else "failed", state.attempts_made)
    return response


# -- deciding, reporting, recording ----------------------------------------------------


def _debug_enabled() -> bool:
    return logger.isEnabledFor(logging.DEBUG)


def _on_error(
    engine: RetryEngine, state: RetryState, exc: Exception, started: float, request: AttemptRequest
) -> Decision:
    verdict = classify_exception(state.policy, exc)
    decision = state.decide(verdict, attempt_started=started, error=describe_error(exc))
    report(engine, state, decision, request, None)
    if isinstance(decision, GiveUp):
        annotate(exc, state.history, decision.reason)
    return decision


def _on_response(
    engine: RetryEngine,
    state: RetryState,
    response: AttemptResponse,
    raw: bytes | None,
    started: float,
    request: AttemptRequest,
) -> tuple[Decision, bytes | None]:
    status = response.status_code
    body: bytes | None = None
    hint: float | None = None
    if status < 400:
        known = _SUCCESS.get(status)
        if known is not None:  # the usual answer: nothing to classify, log or wait for
            done = known[1]
            if state.finished(known[0], done, attempt_started=started, status=status) > 1 or _debug_enabled():
                report(engine, state, done, request, None)
            return done, None
        verdict = Verdict(False, f"status {status}")
    else:
        body = decoded(response, raw) if raw is not None else None
        data = parse_error_body(body)
        parsed = parse_hint(response.headers, data, wall_clock=engine.wall_clock)
        hint = None if parsed is None else parsed.seconds
        verdict = classify_status(state.policy, status, response.headers, data, hint=hint)
        made_of = response.extensions.get(STREAM_ERROR_KEY)
        if made_of is not None:
            verdict = verdict._replace(reason=f"{verdict.reason} ({made_of})")
    decision = state.decide(verdict, attempt_started=started, status=status, hint=hint)
    report(engine, state, decision, request, hint)
    return decision, body


def report(
    engine: RetryEngine, state: RetryState, decision: Decision, request: AttemptRequest, hint: float | None
) -> None:
    """Log the decision; before a retry, emit its `RetryEvent` to the hooks and watchers."""
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
        engine.observers.emit(event)
        engine.watchers.retrying(event)
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
    response: AttemptResponse,
    raw: bytes | None,
    body: bytes | None,
    permit: Permit | None,
    state: RetryState,
    flavor: Flavor,
) -> None:
    """The answer ends the call: the history onto it, the permit settled, an unread body guarded."""
    history = state.history
    extensions = dict(response.extensions)
    extensions[EXTENSION_KEY] = history
    if state.final_reason is not None and response.status_code >= 400:
        extensions[REASON_KEY] = state.final_reason
    response.extensions = extensions
    if raw is not None:
        if permit is not None:
            if body is None:
                body = decoded(response, raw)
            settle_quietly(
                permit,
                response.status_code,
                body if body is not None and len(body) <= MAX_SETTLE_BODY else None,
            )
        return
    # Passed through unread (server-sent events, downloads): once it has started it is
    # never retried, but an error while it is read still gets the call's history.
    recorder: TailRecorder | None = None
    if permit is not None:
        if not is_event_stream(response):
            settle_quietly(permit, response.status_code, None)
        elif getattr(response, "is_closed", False):  # built from bytes (mocks): already read
            settle_quietly(permit, response.status_code, bytes(getattr(response, "content", b""))[-SSE_TAIL:])
        else:
            recorder = TailRecorder(permit, response.status_code)
    if not getattr(response, "is_closed", False):
        stream = response.stream
        continued = extensions.pop(CONTINUE_KEY, None)
        if continued is not None:
            stream = continued(state, stream, extensions)
        response.stream = flavor.guarded_stream(stream, StreamGuard(history, response.status_code, recorder))
