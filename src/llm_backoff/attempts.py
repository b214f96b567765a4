"""The per-call retry state machine and the attempt history it records.

One `RetryState` per logical call (never shared): it is told how each attempt
ended and answers `Retry` (wait this long) or `GiveUp` (why). The checks, in order:

1. the outcome is not retryable (see `classify`) -> give up;
2. the server's hint exceeds ``max_retry_after``, or would begin the retry past
   ``max_retry_at`` after the call started -> give up at once;
3. ``max_attempts`` reached, or ``max_connect_errors`` attempts in a row found no one to
   serve them (``Verdict.unreachable``: could not connect, or the server answered that its
   upstream cannot be reached; any other outcome restarts that count) -> give up;
4. the wait (see `backoff`; under ``max_connect_errors`` an unreachable answer's hint is not
   waited for, as a refused connection has none) would end at or past the start deadline ->
   a shorter wait that still begins in time when one is worth it (`RetryState._fit_to_start`), else
   give up; past the deadline -> give up now rather than sleep pointlessly and fail anyway;
5. the retry budget (if any) refuses -> give up.

Pure: the clock and random source are injected; the budget is the only object
called out to, and only when everything else says retry, so a refused retry
never spends budget credit.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

from .backoff import next_wait
from .classify import Verdict
from .limits import RetryBudgetLike
from .policy import RetryPolicy

Clock = Callable[[], float]

#: A retry fitted before the start deadline begins this fraction of it before the deadline,
#: leaving the server that much budget (``x-request-timeout-ms``) to start it in.
LAST_MARGIN = 0.1

#: Key of the attempt history in ``response.extensions`` and name of the attribute on exceptions.
EXTENSION_KEY = "llm_backoff.attempts"
ATTRIBUTE = "llm_backoff_attempts"
#: Key of the reason a call gave up in ``response.extensions`` (an error status returned as the answer).
REASON_KEY = "llm_backoff.reason"


class Attempt(NamedTuple):
    """How one attempt of a call ended, and what came after it.

    An immutable record (a named tuple: cheap to build on every call, hashable,
    comparable, and printable in logs).
    """

    number: int
    """1-based."""
    status: int | None
    """HTTP status, or None when the attempt raised."""
    error: str | None
    """``"ReadTimeout: timed out"`` when the attempt raised, else None."""
    reason: str
    """The classification, e.g. ``"status 429"``."""
    hint: float | None
    """The server's hint in seconds, if any."""
    wait: float | None
    """Seconds waited after this attempt before the next; None for the last attempt."""
    started: float
    """Seconds from the start of the call to the start of this attempt."""
    duration: float
    """Seconds the attempt took."""


class Retry(NamedTuple):
    wait: float
    reason: str


class GiveUp(NamedTuple):
    reason: str


Decision = Retry | GiveUp


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class RetryState:
    """Decides, attempt after attempt, whether one call goes on. Not thread-safe: one per call."""

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        clock: Clock,
        rng: random.Random,
        budget: RetryBudgetLike | None = None,
        started_at: float | None = None,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._rng = rng
        self._budget = budget
        #: When the call began, on ``clock``'s scale: the deadline counts from here.
        self.started_at = clock() if started_at is None else started_at
        #: When the deadline passes, on ``clock``'s scale (None without a deadline).
        self.expires_at: float | None = None if policy.deadline is None else self.started_at + policy.deadline
        start = policy.start_deadline
        #: When the answer must have begun (``start_deadline``), or None when only ``expires_at`` bounds it.
        self.starts_by: float | None = None if start is None else self.started_at + start
        # start_deadline <= deadline (the policy checks), so the sooner of the two is known now.
        self._begin_by = self.expires_at if self.starts_by is None else self.starts_by
        #: :meth:`time_to_start` ends before the deadline: it is a budget for the answer to begin,
        #: which may then stream on (sent as ``x-request-timeout-scope: start``).
        self.start_bound = self.starts_by is not None and (
            self.expires_at is None or self.starts_by < self.expires_at
        )
        self._attempts: list[Attempt] = []
        self._previous_wait: float | None = None
        self._last_chance_taken = False
        #: Attempts in a row, up to the last one, that no one could serve (``Verdict.unreachable``).
        self._unreachable = 0
        self.final_reason: str | None = None

    @property
    def attempt_number(self) -> int:
        """The number of the attempt about to be made (or being made), 1-based."""
        return len(self._attempts) + 1

    @property
    def history(self) -> tuple[Attempt, ...]:
        return tuple(self._attempts)

    @property
    def last(self) -> Attempt:
        """The attempt recorded last (only valid after the first `decide`)."""
        return self._attempts[-1]

    def elapsed(self) -> float:
        return self._clock() - self.started_at

    @property
    def attempts_made(self) -> int:
        """How many attempts have been recorded (without copying the history)."""
        return len(self._attempts)

    def time_left(self) -> float | None:
        """Seconds until the deadline (may be <= 0), or None without a deadline."""
        expires_at = self.expires_at
        return None if expires_at is None else expires_at - self._clock()

    def time_to_start(self) -> float | None:
        """Seconds until the answer must have begun: by the start deadline or the deadline, if sooner."""
        begin_by = self._begin_by
        return None if begin_by is None else begin_by - self._clock()

    def decide(
        self,
        verdict: Verdict,
        *,
        attempt_started: float,
        status: int | None = None,
        error: str | None = None,
        hint: float | None = None,
    ) -> Decision:
        """Record the attempt that just ended and say what comes next."""
        now = self._clock()
        self._unreachable = self._unreachable + 1 if verdict.unreachable else 0
        decision = self._decide(verdict, hint, now)
        self._attempts.append(
            Attempt(
                number=len(self._attempts) + 1,
                status=status,
                error=error,
                reason=verdict.reason,
                hint=hint,
                wait=decision.wait if isinstance(decision, Retry) else None,
                started=attempt_started - self.started_at,
                duration=now - attempt_started,
            )
        )
        if isinstance(decision, Retry):
            self._previous_wait = decision.wait
        else:
            self.final_reason = decision.reason
        return decision

    def finished(self, verdict: Verdict, decision: GiveUp, *, attempt_started: float, status: int) -> int:
        """Record an attempt whose answer ends the call (a success): `decide` without the checks.

        For a verdict that is not retryable `decide` can only answer ``GiveUp(verdict.reason)``;
        the caller passes that decision in, built once. Returns the number of attempts made.
        """
        now = self._clock()
        # tuple.__new__ skips the named tuple's keyword-handling __new__ (a Python function)
        self._attempts.append(
            tuple.__new__(
                Attempt,
                (
                    len(self._attempts) + 1,
                    status,
                    None,
                    verdict.reason,
                    None,
                    None,
                    attempt_started - self.started_at,
                    now - attempt_started,
                ),
            )
        )
        self.final_reason = decision.reason
        return len(self._attempts)

    def cut(self, verdict: Verdict, *, error: str | None = None, hint: float | None = None) -> Decision:
        """The answer recorded last had begun and was then cut: decide on it again as ``verdict``.

        Its record is replaced (same number, its duration now up to the cut). An answer that
        has begun is past its start deadline's purpose, so from here on the call's retries
        answer to ``deadline``, ``max_attempts``, ``max_retry_after`` and the budget only.
        """
        last = self._attempts.pop()
        self.final_reason = None
        self.policy = self.policy.model_copy(
            update={"start_deadline": None, "max_retry_at": None, "last_chance": 0.0}
        )
        self.starts_by = None
        self._begin_by = self.expires_at
        self.start_bound = False
        return self.decide(
            verdict,
            attempt_started=self.started_at + last.started,
            status=last.status,
            error=error,
            hint=hint,
        )

    def _decide(self, verdict: Verdict, hint: float | None, now: float) -> Decision:
        policy = self.policy
        if not verdict.retryable:
            return GiveUp(verdict.reason)
        if hint is not None and hint > policy.max_retry_after:
            return GiveUp(
                f"{verdict.reason}: server asked to wait {hint:g} s, above max_retry_after "
                f"({policy.max_retry_after:g} s)"
            )
        start = policy.start_deadline
        latest = policy.max_retry_at
        elapsed = now - self.started_at
        if hint is not None and latest is not None and elapsed + hint > latest:
            return GiveUp(
                f"{verdict.reason}: server asked to wait {hint:g} s, which would begin the retry "
                f"past max_retry_at ({latest:g} s; {elapsed:.3g} s elapsed)"
            )
        number = len(self._attempts) + 1
        if number >= policy.max_attempts:
            return GiveUp(f"{verdict.reason}: max_attempts ({policy.max_attempts}) reached")
        cap = policy.max_connect_errors
        if cap is not None:
            if self._unreachable >= cap:
                return GiveUp(
                    f"{verdict.reason}: {self._unreachable} attempts in a row could not connect or "
                    f"found the upstream unavailable, max_connect_errors ({cap}) reached"
                )
            if verdict.unreachable:
                # Counted as a refused connection, so retried as one: after the computed backoff.
                # The shim's hint is the outage's length so far (up to 30 s), for callers riding
                # it out (max_connect_errors=None); a capped caller gives up within a few
                # attempts anyway, and waiting it would make a dead engine behind a shim cost
                # seconds where the dead engine alone costs a second.
                hint = None
        wait = next_wait(policy, number - 1, hint, self._previous_wait, self._rng)
        # A retry is an answer not yet begun: the start deadline (<= deadline) binds first.
        if start is not None and elapsed + wait >= start:
            fitted = self._fit_to_start(policy, start, elapsed, wait, hint)
            if fitted is None:
                return GiveUp(
                    f"{verdict.reason}: waiting {wait:.3g} s would pass the {start:g} s start deadline "
                    f"({elapsed:.3g} s elapsed)"
                )
            wait = fitted
        if policy.deadline is not None and elapsed + wait >= policy.deadline:
            return GiveUp(
                f"{verdict.reason}: waiting {wait:.3g} s would pass the {policy.deadline:g} s deadline "
                f"({elapsed:.3g} s elapsed)"
            )
        if self._budget is not None and not self._budget.try_spend():
            return GiveUp(f"{verdict.reason}: retry budget exhausted")
        return Retry(wait, verdict.reason)

    def _fit_to_start(
        self, policy: RetryPolicy, start: float, elapsed: float, wait: float, hint: float | None
    ) -> float | None:
        """A shorter wait that still begins the retry before the start deadline, or None: give up.

        The retry is placed at the latest useful moment, `LAST_MARGIN` of the start
        deadline before it (so the server is still given some budget to start it in):

        - when the wait's floor (the server's hint; a computed backoff has none) fits
          before that moment, only the jitter on top of it pushed the retry out: it is
          trimmed, rather than failing a call the server said it could take in time;
        - when the hint itself passes the start deadline, but by at most
          ``last_chance`` of it, one last attempt is made at that moment: a server's
          hint is an upper bound (slots free up as answers end early), and a server that
          still cannot start the request in the budget left refuses it at once;
        - otherwise (a hint far past it, or the last chance already taken) None.
        """
        latest = start * (1.0 - LAST_MARGIN)
        room = latest - elapsed
        if room <= 0:
            return None
        floor = hint if hint is not None and hint > 0 else 0.0
        if floor < room:
            return min(wait, room)
        if (
            policy.last_chance > 0
            and not self._last_chance_taken
            and elapsed + floor <= start * (1.0 + policy.last_chance)
        ):
            self._last_chance_taken = True
            return room
        return None


def format_history(attempts: tuple[Attempt, ...], final_reason: str | None = None) -> str:
    """A multi-line summary for exception notes and logs."""
    total = attempts[-1].started + attempts[-1].duration if attempts else 0.0
    plural = "s" if len(attempts) != 1 else ""
    lines = [f"llm_backoff: {len(attempts)} attempt{plural} in {total:.3g} s"]
    if final_reason:
        lines[0] += f", gave up: {final_reason}"
    for a in attempts:
        outcome = f"status {a.status}" if a.status is not None else (a.error or "error")
        parts = [f"  #{a.number} {outcome}"]
        if a.hint is not None:
            parts.append(f"hint {a.hint:.3g} s")
        if a.wait is not None:
            parts.append(f"waited {a.wait:.3g} s")
        lines.append(", ".join(parts))
    return "\n".join(lines)


def annotate(exc: BaseException, attempts: tuple[Attempt, ...], reason: str | None) -> None:
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
