"""The figures of one run (pure: records in, numbers out); :mod:`~llm_backoff_shim.lab.report` prints them.

Definitions (the exact rules used):

- **success within deadline**: calls whose stream ended normally before the caller's
  deadline, over all calls. A call cut at its deadline is a failure even if the engine
  was still generating for it.
- **TTFT**: from the moment the caller started the call (retries and waits included)
  to the first content token, for interactive calls that succeeded. Percentiles are
  nearest-rank (p99 of 50 values is the largest), so no value is interpolated.
- **time to rejection**: from sending an HTTP attempt (its last byte written) to
  receiving its 429/503 response headers (as the client sees it, so the load
  generator's own event-loop lag in noticing the answer is included), over every
  rejected attempt. Not from the request's head: the HTTP library writes head and
  body in two writes, with this process's other calls in between; the figure from the
  head is given beside it (``rejection_from_head_p99``). That includes requests that waited
  in a proxy's queue and were then turned away (``queue_timeout``); the ``queue_full``
  answers alone show how fast a refusal at arrival is. When the shim's access log
  was matched (:func:`~llm_backoff_shim.lab.load_records.attach_shim_times`), the same
  rejected attempts are also timed as the shim saw them (``total_ms``: from the
  request's head reaching the shim's app to the end of its answer, so it includes
  the wait for the body the client has not written yet), which leaves out the time
  on the wire.
- **attempts per success**: all HTTP attempts of all calls, over the successful calls.
- **goodput**: successful calls per second over the run (from t = 0 until the last
  caller has succeeded or given up), as a fraction of the engine's capacity. While
  any caller is still waiting for an answer, every second the engine spends idle or
  on a caller who already left counts against it.
- **wasted engine work**: tokens the engine generated for requests whose caller had
  already gone (the simulator's ``aborted_tokens``), as a share of all tokens it
  generated. A caller never receives a completion after its deadline here: it closes
  the connection at the deadline, so that work is counted by the engine as aborted.
- **retry wave**: the most retries (attempts after a call's first) sent within any
  100 ms window.
- **admitted on first retry**: among calls whose first attempt was rejected and that
  retried, the share whose second attempt was not rejected.
- **failed fast**: failed calls that ended with a typed error before their deadline;
  the others ran into the deadline, either still waiting for a first token or
  *mid-stream* (tokens had started to arrive and the stream was cut: the engine
  worked for a caller who then left).
- **served within budget**: a call that completed before its deadline and whose first
  token came within its class's TTFT budget (interactive: the scenario's
  ``ttft_budget``; batch: its deadline, so every completed batch call is).
- **useful tokens**: answer tokens (``usage.completion_tokens``) of the calls served within
  budget: interactive tokens that began in time plus batch tokens delivered by their
  deadline. Against it, the **ceiling**: the engine's answer tokens/s at full load times
  (the arrival window + the batch deadline), the most any scheduler could deliver.
- **failures under 1 s**: the share of failed calls whose caller knew within 1 s
  (:data:`FAST_FAILURE`) of starting; **p90 time to failure** over the failed calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from llm_backoff_shim.lab.load_records import CallRecord, RunResult
from llm_backoff_shim.serve.observe.access_log import json_records

WAVE_WINDOW = 0.1
#: A failure a caller learns of within this many seconds "failed fast".
FAST_FAILURE = 1.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def max_in_window(times: Iterable[float], window: float = WAVE_WINDOW) -> int:
    """The largest number of ``times`` inside any half-open window ``[t, t + window)``."""
    ordered = sorted(times)
    best = 0
    lo = 0
    for hi, t in enumerate(ordered):
        while ordered[lo] <= t - window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


@dataclass(frozen=True)
class Figures:
    label: str
    calls: int
    interactive_calls: int
    ok: int
    ok_interactive: int
    success_rate: float
    failed_fast: int
    failed_deadline: int
    deadline_while_served: int
    median_time_to_fail_fast: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    ttft_budget: float
    rejections: int
    rejection_p50: float | None
    rejection_p99: float | None
    queue_full_p99: float | None
    shim_rejection_p50: float | None
    shim_rejection_p99: float | None
    shim_rejections_matched: int
    rejections_by_code: dict[str, int]
    attempts: int
    attempts_per_success: float | None
    retries: int
    retry_wave: int
    first_retry_admitted: float | None
    first_retries: int
    run_span: float
    goodput: float
    capacity: float
    goodput_fraction: float
    tokens_generated: int
    wasted_tokens: int
    wasted_fraction: float
    engine_peak_waiting: int | None
    proxy_peak_queued: int | None
    errors: dict[str, int]
    #: The shim's own rejections by when they were decided (:func:`rejections_by_when`), if read.
    shim_rejections_by_when: dict[str, int] | None = None
    #: The caller-side time to rejection measured from the request's head (so it includes
    #: the client's own gap between head and body; ``rejection_p99`` is from its last
    #: byte), and p99 of the load generator's own time to write a rejected request (head
    #: started to last byte written).
    rejection_from_head_p99: float | None = None
    rejection_write_p99: float | None = None
    #: The shim's own time to rejection from the request's body read in full (its access
    #: log's ``total_ms - body_ms``): the shim's work without the wait for the client's body.
    shim_rejection_after_body_p99: float | None = None
    #: Rejections the shim answered from the request's head, before its body (no ``body_ms``
    #: in its access log: ``Proxy.refuse_from_head``); not in the figure above.
    shim_refused_from_head: int = 0
    #: On the wire (kernel timestamps of the loopback segments, bench/_wire.py, root only):
    #: from the request's last byte to the answer's first, p99 over the rejected attempts
    #: matched, and how many were. Neither the load generator's loop nor the shim's is in it
    #: as a delay before reading; the shim's whole handling is.
    wire_rejection_p99: float | None = None
    wire_rejections: int = 0
    #: Served within budget (module doc): interactive calls, and batch calls completed.
    interactive_within_budget: int = 0
    batch_calls: int = 0
    batch_ok: int = 0
    useful_tokens: int = 0
    #: The most any scheduler could deliver (module doc); None without the engine's token rate.
    useful_ceiling: float | None = None
    failed_under_1s: int = 0
    failure_p90: float | None = None
    preemptions: int = 0

    @property
    def interactive_late(self) -> int:
        """Interactive calls that completed by their deadline but whose first token came after
        the TTFT budget: a success within deadline, not served within budget."""
        return self.ok_interactive - self.interactive_within_budget

    @property
    def batch_served(self) -> float | None:
        return self.batch_ok / self.batch_calls if self.batch_calls else None

    @property
    def useful_fraction(self) -> float | None:
        return self.useful_tokens / self.useful_ceiling if self.useful_ceiling else None

    @property
    def failed_fast_share(self) -> float | None:
        failed = self.calls - self.ok
        return self.failed_under_1s / failed if failed else None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _first_retry_stats(calls: Sequence[CallRecord]) -> tuple[int, int]:
    retried = admitted = 0
    for call in calls:
        if len(call.attempts) >= 2 and call.attempts[0].rejected:
            retried += 1
            second = call.attempts[1]
            if second.status is not None and second.status < 400:
                admitted += 1
    return retried, admitted


def figures(result: RunResult) -> Figures:
    calls = result.calls
    ok = [c for c in calls if c.ok]
    interactive = [c for c in calls if c.cls == "interactive"]
    ok_interactive = [c for c in ok if c.cls == "interactive"]
    failed = [c for c in calls if not c.ok]
    fast = [c for c in failed if c.outcome == "error"]
    attempts = [a for c in calls for a in c.attempts]
    rejected = [a.latency for a in attempts if a.rejected and a.latency is not None]
    at_arrival = [a.latency for a in attempts if a.code == "queue_full" and a.latency is not None]
    shim_side = [a.shim_seconds for a in attempts if a.rejected and a.shim_seconds is not None]
    after_body = [
        a.shim_seconds - a.shim_body_seconds
        for a in attempts
        if a.rejected and a.shim_seconds is not None and a.shim_body_seconds is not None
    ]
    from_head = [a.latency_from_head for a in attempts if a.rejected and a.latency_from_head is not None]
    writing = [
        a.body_sent - a.written
        for a in attempts
        if a.rejected and a.body_sent is not None and a.written is not None
    ]
    by_code: dict[str, int] = {}
    for a in attempts:
        if a.rejected:
            key = f"{a.status} {a.code}" if a.code else str(a.status)
            by_code[key] = by_code.get(key, 0) + 1
    retry_times = [a.sent for c in calls for a in c.attempts[1:]]
    retried, admitted = _first_retry_stats(calls)
    window = max((c.end for c in calls if c.end is not None), default=0.0)
    goodput = len(ok) / window if window > 0 else 0.0
    stats = result.engine_stats
    generated = int(stats.get("tokens_generated", 0))
    wasted = int(stats.get("aborted_tokens", 0))
    errors: dict[str, int] = {}
    for c in failed:
        key = c.error or c.outcome or "unknown"
        errors[key] = errors.get(key, 0) + 1
    batch = [c for c in calls if c.cls == "batch"]
    served = [c for c in calls if c.within_budget]
    failure_times = [c.duration for c in failed if c.duration is not None]
    scenario = result.scenario
    ceiling = (
        None
        if result.token_capacity is None
        else result.token_capacity * (scenario.duration + scenario.deadline_of("batch"))
    )
    engine_waiting = [s.engine_waiting for s in result.samples if s.engine_waiting is not None]
    proxy_queued = [s.proxy_queued for s in result.samples if s.proxy_queued is not None]
    return Figures(
        label=result.setup.label,
        calls=len(calls),
        interactive_calls=len(interactive),
        ok=len(ok),
        ok_interactive=len(ok_interactive),
        success_rate=len(ok) / len(calls) if calls else 0.0,
        failed_fast=len(fast),
        failed_deadline=len(failed) - len(fast),
        deadline_while_served=sum(1 for c in failed if c.outcome == "deadline" and c.first_token is not None),
        median_time_to_fail_fast=percentile([c.duration for c in fast if c.duration is not None], 50),
        ttft_p50=percentile([c.ttft for c in ok_interactive if c.ttft is not None], 50),
        ttft_p99=percentile([c.ttft for c in ok_interactive if c.ttft is not None], 99),
        ttft_budget=result.scenario.ttft_budget,
        rejections=sum(1 for a in attempts if a.rejected),
        rejection_p50=percentile(rejected, 50),
        rejection_p99=percentile(rejected, 99),
        queue_full_p99=percentile(at_arrival, 99),
        shim_rejection_p50=percentile(shim_side, 50),
        shim_rejection_p99=percentile(shim_side, 99),
        shim_rejections_matched=len(shim_side),
        rejections_by_code=dict(sorted(by_code.items(), key=lambda kv: -kv[1])),
        attempts=len(attempts),
        attempts_per_success=len(attempts) / len(ok) if ok else None,
        retries=len(retry_times),
        retry_wave=max_in_window(retry_times),
        first_retry_admitted=admitted / retried if retried else None,
        first_retries=retried,
        run_span=window,
        goodput=goodput,
        capacity=result.capacity,
        goodput_fraction=goodput / result.capacity if result.capacity > 0 else 0.0,
        tokens_generated=generated,
        wasted_tokens=wasted,
        wasted_fraction=wasted / generated if generated else 0.0,
        engine_peak_waiting=max(engine_waiting, default=None),
        proxy_peak_queued=max(proxy_queued, default=None),
        errors=dict(sorted(errors.items(), key=lambda kv: -kv[1])),
        rejection_from_head_p99=percentile(from_head, 99),
        rejection_write_p99=percentile(writing, 99),
        shim_rejection_after_body_p99=percentile(after_body, 99),
        shim_refused_from_head=sum(
            1 for a in attempts if a.rejected and a.shim_seconds is not None and a.shim_body_seconds is None
        ),
        interactive_within_budget=sum(1 for c in served if c.cls == "interactive"),
        batch_calls=len(batch),
        batch_ok=sum(1 for c in batch if c.ok),
        useful_tokens=sum(c.tokens for c in served),
        useful_ceiling=ceiling,
        failed_under_1s=sum(1 for t in failure_times if t < FAST_FAILURE),
        failure_p90=percentile(failure_times, 90),
        preemptions=int(stats.get("preemptions", 0)),
    )


#: How the shim's access log ``detail`` of a rejection says a queued request left (the messages
#: of :mod:`llm_backoff_shim.decide.placement` and :mod:`llm_backoff_shim.decide.refusals`); anything
#: else was refused at arrival.
_LEFT_THE_QUEUE = (
    ("overtaken in the queue", "recheck"),
    ("waited the maximum", "timer"),
    ("request budget (x-request-timeout-ms) ran out while queued", "timer"),
    ("remaining request budget", "head"),
)
REJECTION_WHEN = ("arrival", "recheck", "timer", "head")


def rejections_by_when(access_log: str) -> dict[str, int]:
    """The shim's rejections of generation requests, by when they were decided.

    ``arrival``: refused before queueing; ``recheck``: a queued request the safety net turned
    away because the estimate moved (:meth:`AdmissionController.recheck`); ``timer``: it
    waited its ``--max-queue-wait`` or its budget; ``head``: at the head of the queue, what
    was left of its budget no longer covered the service. Read from the JSON access log.
    """
    counts = dict.fromkeys(REJECTION_WHEN, 0)
    for entry in json_records(access_log):
        if entry.get("outcome") != "rejected":
            continue
        detail = str(entry.get("detail") or "")
        when = next((name for prefix, name in _LEFT_THE_QUEUE if detail.startswith(prefix)), "arrival")
        counts[when] += 1
    return counts
