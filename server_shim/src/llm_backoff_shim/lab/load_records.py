"""What a load run records: each logical call, each of its HTTP attempts, queue samples, progress.

Filled in by :mod:`llm_backoff_shim.lab.loadgen` (calls, samples) and
:mod:`llm_backoff_shim.lab.attempt_capture` (attempts); read by the figures, reports and
plots. :func:`attach_shim_times` adds the shim's own view of each attempt: every attempt
carries an ``x-request-id`` (``<call>-<attempt>``), the shim logs it in its access log,
and the shim's ``total_ms`` (arrival to answer, measured inside the shim) goes next to the
client-side latency, which includes the load generator's own event-loop lag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from llm_backoff_shim.lab.scenario import RequestClass, Scenario, Setup
from llm_backoff_shim.serve.observe.access_log import json_records

Outcome = Literal["ok", "error", "deadline"]
REJECT_STATUSES = frozenset({429, 503})


@dataclass
class AttemptRecord:
    number: int
    sent: float
    """When the attempt reached the bottom of the client's stack (before a connection is taken)."""
    answered: float | None = None
    """When the response's head had been read off the connection."""
    status: int | None = None
    error: str | None = None
    code: str | None = None
    """``error.code`` of an error answer (``queue_full``, ``queue_timeout``...), when it has one."""
    shim_seconds: float | None = None
    """The shim's own arrival-to-answer time for this attempt (its access log), when known."""
    shim_body_seconds: float | None = None
    """Of :attr:`shim_seconds`, the time from the request's head to its body read in full
    (the access log's ``body_ms``): waiting for the client to send it, when known."""
    written: float | None = None
    """When the request's head started going onto its connection (the HTTP library's trace
    events); None when the library did not report it."""
    body_sent: float | None = None
    """When the request's last byte (its body) had been written to its connection; None when
    the library did not report it. From ``written`` to here is this process's own doing."""

    @property
    def rejected(self) -> bool:
        return self.status in REJECT_STATUSES

    @property
    def latency(self) -> float | None:
        """Seconds from the request's last byte written to having read the response's head (None
        when no response came): the wire's round trip plus the server's time, plus this
        process's own event-loop lag in noticing the answer. From the head's write
        (:attr:`latency_from_head`) when the last byte was not traced.

        Not from the head: the HTTP library writes a request's head and body in two writes,
        and under a burst this process's event loop runs other calls between them (up to
        tens of ms); a server cannot
        answer a request it has not been sent yet."""
        if self.answered is None:
            return None
        return self.answered - self.body_sent if self.body_sent is not None else self.latency_from_head

    @property
    def latency_from_head(self) -> float | None:
        """Seconds from the request's head starting onto the wire (from ``sent`` when that
        was not traced) to having read the response's head; None when no response came."""
        if self.answered is None:
            return None
        return self.answered - (self.sent if self.written is None else self.written)


@dataclass
class CallRecord:
    """One logical call. ``tokens``/``prompt_tokens``: the answer's ``usage`` (the tokens
    streamed, when no usage came); ``ttft_budget`` None means the deadline."""

    index: int
    cls: RequestClass
    scheduled: float
    deadline: float
    start: float = 0.0
    first_token: float | None = None
    end: float | None = None
    outcome: Outcome | None = None
    error: str | None = None
    tokens: int = 0
    attempts: list[AttemptRecord] = field(default_factory=list)
    ttft_budget: float | None = None
    max_tokens: int | None = None
    prompt_tokens: int = 0
    streamed: int = 0
    """Content chunks received (about one token each); what a caller who left got."""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def within_budget(self) -> bool:
        """Completed before its deadline, its first token within its TTFT budget."""
        if not self.ok or self.ttft is None:
            return False
        budget = self.deadline if self.ttft_budget is None else self.ttft_budget
        return self.ttft <= budget

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


@dataclass(frozen=True)
class Sample:
    t: float
    engine_running: int | None
    engine_waiting: int | None
    proxy_queued: int | None
    proxy_in_flight: int | None
    #: In a fleet, each replica's (engine running, engine waiting, shim queued, shim in flight),
    #: in replica order (None where unread); the fields above are their sums. Empty otherwise.
    replicas: tuple[tuple[int | None, int | None, int | None, int | None], ...] = ()
    #: A shim with a cost budget: the cost it holds in flight (``/shim/state``'s
    #: ``in_flight_tokens``, summed over shims); None without one.
    proxy_in_flight_tokens: int | None = None
    #: Requests in flight per class at the shim(s); empty when unread.
    proxy_in_flight_by_class: dict[str, int] = field(default_factory=dict)


@dataclass
class RunResult:
    """``engine_stats``: the simulator's ``/sim/stats`` after the run, or for another engine
    (vLLM) ``tokens_generated`` (its ``vllm:generation_tokens_total`` over the run) and
    ``aborted_tokens`` (those not delivered in a completed answer). ``token_capacity``:
    answer tokens/s the engine sustains (None: unknown), for the useful-token ceiling."""

    setup: Setup
    scenario: Scenario
    capacity: float
    calls: list[CallRecord]
    samples: list[Sample]
    engine_stats: dict[str, Any]
    elapsed: float
    token_capacity: float | None = None


@dataclass(frozen=True)
class Progress:
    t: float
    sent: int
    total: int
    ok: int
    failed: int
    active: int
    attempts: int
    engine_waiting: int | None
    proxy_queued: int | None


def attempt_id(call: int, attempt: int) -> str:
    """The ``x-request-id`` the load generator sends with attempt ``attempt`` of call ``call``."""
    return f"{call}-{attempt}"


def attach_shim_times(calls: Sequence[CallRecord], access_log: str) -> int:
    """Fill :attr:`AttemptRecord.shim_seconds` from a shim's JSON access log; returns how many matched.

    Lines that are not JSON access records (start-up messages, other loggers) are skipped.
    """
    seen: dict[str, tuple[float, float | None]] = {}
    for entry in json_records(access_log):
        rid, total, body = entry.get("request_id"), entry.get("total_ms"), entry.get("body_ms")
        if isinstance(rid, str) and isinstance(total, (int, float)):
            read = float(body) / 1000.0 if isinstance(body, (int, float)) else None
            seen[rid] = (float(total) / 1000.0, read)
    matched = 0
    for call in calls:
        for attempt in call.attempts:
            found = seen.get(attempt_id(call.index, attempt.number))
            if found is not None:
                attempt.shim_seconds, attempt.shim_body_seconds = found
                matched += 1
    return matched
