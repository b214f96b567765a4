"""What calibrate measures and concludes (pure): the samples of a level, a request's cost, the knee.

**The knee.** Where to cap concurrency: the knee of a load ramp, judged by what LLM users feel.

Input: the :class:`StepStats` of a closed-loop ramp, one or more measurements per
concurrency level (what ``llm-backoff-shim calibrate`` measures). Output: a :class:`Knee`,
the next level worth measuring (:func:`next_level`), and a :class:`Recommendation` for
``llm-backoff-shim serve``.

What users feel is the time to their first token and the pace of the tokens after it,
not the whole request's latency, which mostly follows how long the answer is. So:

1. A level is **within the SLO** when, on the median of its measurements, its p99 TTFT
   is at most ``ttft_slo``, its p99 time per output token (TPOT: a request's mean gap
   between tokens after the first) at most ``tpot_slo`` (when set), and at most
   ``max_error_ratio`` of its requests failed.

   1b. When the engine exports ``vllm:num_requests_waiting`` (the caller samples it over each
   window: :class:`StepStats` ``engine_waiting``), a level is also judged by the engine's own
   queue: one whose median measurement saw a median of more than 0 requests waiting inside
   the engine is not a knee, whatever it gains. Past the engine's slots (``--max-num-seqs``) a closed loop
   buys a few percent of tokens/s (a queued request takes a freed slot without the client's
   turnaround) by making every request wait in the engine, where the shim's classes do not
   count: on an 8-sequence vLLM, 12 workers did 8 % more tokens/s than 8 and moved TTFT p50
   from 0.045 to 0.535 s, and chat through the shim fared worse with that cap.
   The shim's own queue turns a slot over almost as fast (it admits the next request at the
   release, one loopback hop from the engine), and there interactive goes first.
   Without the metrics the rule is the SLOs alone; when even the lowest level measured kept a
   queue (another client's traffic), the queue is not the ramp's doing and is ignored.
2. Its **throughput** is answer tokens per second (requests per second when the upstream
   counted no tokens): normalised by answer length, so a level that happened to draw
   longer answers is not mistaken for a faster one. The median of its measurements.
3. The **knee** is the lowest level within the SLO whose throughput is at least
   ``1 - tolerance`` of the best throughput any level within the SLO reached: as much of
   the engine as the SLO allows, at the lowest concurrency (the shortest queue inside the
   engine) that gets it. Latency growing faster than throughput is *not* a knee while
   the SLO holds: a TTFT going from 64 to 125 ms against a 1 s SLO costs users nothing
   and the throughput it buys is real.
4. **Climbing** goes on while the highest level measured is within the SLO and the
   throughput still rises: it, or the level below it, beat every lower level by more than
   ``gain``. Two levels in a row that add nothing mean the engine is full.
5. **Repeating**: a machine's noise can fake a rise, a plateau or an SLO miss. The knee
   and the level above it (the one that stopped the climb) are measured again, up to
   ``max_repeats`` times each, until each has ``min_repeats`` measurements and one more
   round did not move the knee. Between the knee and a level above it that missed the
   SLO, the midpoint is measured too (at most ``refine`` levels between two levels of the
   ramp), so a capacity between two doubling levels is found; above a level that kept a queue
   in the engine, the level its engine ran at once (median ``vllm:num_requests_running``: the
   engine's slots) is measured instead of the midpoint. Measurements of the knee or
   the level above that disagree on the SLO, or whose throughputs spread by more than
   twice ``tolerance``, are repeated too (up to ``max_repeats``).
6. **Confidence**: ``high`` when the knee held still over its last round, every
   measurement of it and of the level above agrees with their SLO verdicts, their
   throughputs spread by at most twice ``tolerance`` and each counted at least
   ``min_requests`` requests; ``medium`` when it held still but measurements disagreed (an
   SLO verdict flipped, throughputs spread by more than twice ``tolerance``) or one counted
   too few requests; ``low`` when it was still moving, or rests on a single measurement.
   Disagreement or spread at a level above the knee within :data:`REPRODUCIBLE` (15 %) of
   it does not count: whichever of the two is the knee, the recommendation moves by less.
   This is one run's own verdict: every repeat of a run can agree with itself while a second
   run picks another level. ``calibrate`` earns the confidence it prints across runs
   (:mod:`llm_backoff_shim.lab.calibrate.history`: ``high`` only when two runs agree within
   :data:`REPRODUCIBLE`).

The recommendation at knee ``K`` with SLO ``S`` (seconds, p99 TTFT):

- ``max_concurrency = K``;
- ``max_queue_wait = B - TTFT_p99(K)`` (floored to 10 ms, at least 10 ms), with ``B`` the
  seconds a chat caller gives a call to start (``interactive_budget``, default
  :data:`INTERACTIVE_BUDGET`, the SDK's ``RetryPolicy.interactive()`` start deadline, 5 s):
  a request admitted after waiting that long still gets its first token within the caller's
  budget. Not ``S - TTFT_p99(K)``: the SLO judges the engine (where the knee is); the queue
  serves callers, and in the virtual-time model of the real-vLLM comparison (2.5x capacity,
  70 % interactive, 5 s budget) the SDK's presets got
  313 chat calls within budget with a 4.5 s wait against 288 at 0.9 s and 197 at 0.18 s
  (waits sized from the TTFT SLO's headroom), plain-openai-like callers 248, 238 and 214. An
  SDK caller sends its budget (``x-request-timeout-ms``) and the shim caps its wait by it;
- no queue bound: the shim sizes each class's queue to what the engine drains within the
  class's wait at the pace it measures as it serves (``serve --max-queue`` unset), the
  figure a count from this run (requests/s at K times the wait) would be, kept current. A
  count measured here moved with the machine's pace (30, then 44, 42 and 45 interactive
  places on one vLLM within ten minutes) and goes stale when the engine slows; the wait, the
  concurrency and the cost budget are what a run measures to within a few percent.
- The ``batch`` class is held rather than told to come back: it waits in the shim up to
  ``batch_wait`` (``--batch-queue-wait``, default :data:`BATCH_QUEUE_WAIT`; a caller that
  sends a shorter budget in ``x-request-timeout-ms`` waits at most that), behind every
  interactive request. A batch caller told a Retry-After is away when a slot frees, and the
  slot stands idle; one held in the queue takes it at once. On the real vLLM the SDK's presets
  went from 0.94x to 1.46x plain openai's interactive calls within budget through the same
  shim, and from 1.15x to 1.60x its useful tokens; batch served fell from 99 % to 69 %
  (plain's from 69 % to 36 %).
- ``max_inflight_tokens``: the cost budget, when the caller measured one (calibrate: what
  the knee's slots of the mix hold 95 % of the time, :class:`SlotCost`, :func:`budget_tokens`).
- With batch held, Retry-After is capped at :data:`HELD_RETRY_AFTER_MAX` (``--retry-after-max``):
  a batch caller refused past the held queue's wait would otherwise be told a slot 15 s or
  more ahead, and cannot be called back when the work ahead of it melts away (interactive
  callers giving up, answers shorter than estimated); at the end of an overload the engine
  then idles while it sleeps. Capped, it asks again within a few seconds and is told again
  on the queue as it is then (a refusal costs the shim about 0.1 ms).

**The samples.** One request as the client saw it, one level's statistics from its steady window.

Percentiles interpolate linearly between ranks, as numpy's default does, with the stdlib
alone: calibrate runs where only the shim is installed (its PNG aside).

**The cost.** What a request costs the engine, and the in-flight cost budget calibrate recommends.

Calibrate prices its requests as the shim's cost cap prices them
(:mod:`llm_backoff_shim.decide.pricing`), so the budget it recommends is in the shim's units:

- the prompt in the engine's own tokens: the upstream's ``usage.prompt_tokens`` (while a
  request runs, its words at the tokens per word the upstream has counted so far); the shim
  counts prompts at the bytes per token the engine's ``/tokenize`` reports, the same units;
- the answer at what this engine's recent answers were: the same estimator the shim uses
  (:class:`~llm_backoff_shim.decide.answer_length.AnswerLengths`, 90th percentile of the
  answers seen so far in the run), **not capped by the request's own** ``max_tokens``. The
  shim prices a request asking for more than that (4096, or none) at that quantile, so the
  budget is made of requests priced as such a client's: with K in flight (the knee) it holds
  K such requests of the mix's prompts, and a client naming ``max_tokens: 4096`` or none is
  never priced above the requests the budget was measured with.

The recommended ``--max-inflight-tokens`` (:func:`budget_tokens`) is the cost K slots of the
mix hold together at or below 95 % of the time, K the knee (:class:`SlotCost`): each slot holds a
request of the mix, a long-prompt one with the ``--long-share`` named and a chat one otherwise,
its prompt one of the run's completed requests of that kind (the upstream's count) and its
answer at the price the run's answers taught; the sum of K such slots is taken as normal,
``K * mean + z(0.95) * sqrt(K) * sd``. The mix's ordinary pile-ups of long prompts run together
under it; what it holds back is a rarer one, and so it caps how many long prefills the engine
runs at once (on the 8-slot CPU vLLM with 20 % prompts of 1.5-3k tokens, about 9,600 tokens:
three long prompts beside five chats, not a fourth; without a budget the engine's answer pace
on that mix fell from 615-660 to 461-469 tokens/s).

Why not the cost in flight measured at the knee, the 95th percentile over its windows' time
(:func:`cost_quantile`, :attr:`StepStats.inflight_cost_high`, still in the JSON): a window of a
few seconds at 8 slots holds a handful of long prompts, so its high quantile is how many of
them happened to overlap, two or three. Ten runs on one vLLM gave 6,400 to 8,320 from it (30 %
apart; others up to 9,664), and this budget 9,600 to 10,112 from the same runs (5 %). Its
per-slot figures come from every request the run completed (about 200, a sixth of them long),
and the share of long prompts is the one named, not the one drawn (16-18 % in those runs). The same
sum over the run's requests at the share drawn moved by 10 % (8,608-9,466), and the knee's
time-weighted mean cost in flight, which a fixed factor would scale, by 9 %.
Slots are filled by count, not by how long each kind holds one: on that vLLM the knee's
time-weighted mean cost in flight moved between 4,650 and 7,830 over thirteen runs (three of
them with other ``--seed`` values, whose budgets were 9,536-10,048), around the count-weighted
5,490-5,740; weighting by the few long requests' durations would bring that noise back.
The normal sum is 3.5 % below the exact one (the K-fold convolution of the slot's
distribution) there.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Literal

from llm_backoff.policy import INTERACTIVE_START_DEADLINE
from llm_backoff_shim.decide.answer_length import AnswerLengths, Clock

# -- the knee ------------------------------------------------------------------------------

#: What bounded the knee: the level above missed the SLO, kept a queue inside the engine, added no
#: throughput, or was not measured.
Limit = Literal["slo", "engine_queue", "plateau", "max_level"]
Confidence = Literal["high", "medium", "low"]

#: Smallest ``--max-queue-wait`` recommended (the shim needs a positive wait).
MIN_QUEUE_WAIT = 0.01
#: Seconds an interactive (chat) caller gives a call to start: the SDK's
#: ``RetryPolicy.interactive()`` start deadline, which it sends as ``x-request-timeout-ms``.
#: The interactive queue's wait is what it leaves after the knee's p99 TTFT (module docstring).
INTERACTIVE_BUDGET = INTERACTIVE_START_DEADLINE
#: Seconds a batch request may wait in the shim for a slot (``batch_wait``, module docstring):
#: long enough to ride out seconds of interactive overload, within the 20-60 s a batch caller
#: commonly allows a call.
BATCH_QUEUE_WAIT = 15.0
#: The longest Retry-After recommended while batch is held (module docstring). In the
#: virtual-time model of the real-vLLM comparison, slot-time idle while a caller waited went
#: from 8.5 % to 1.7 % for the SDK's presets (3 s: 0.7 %, 8 s: 1.8 %); below the interactive
#: preset's 2 s, its callers would wait out every hint instead of failing fast.
HELD_RETRY_AFTER_MAX = 5.0
#: How far apart two runs' recommendations may be and still agree: doubt about a level above
#: the knee within this fraction of it does not lower the confidence (rule 6).
REPRODUCIBLE = 0.15


class KneeInputError(ValueError):
    """Step measurements the knee finder cannot work with (negative, NaN...)."""


@dataclass(frozen=True)
class StepStats:
    """One measurement of one concurrency level of a closed-loop ramp. Times in seconds.

    ``requests`` counts successful requests that entered the statistics; with none, the
    latency fields are 0 and ``throughput`` is 0. ``itl_*`` are per-request TPOTs.
    """

    concurrency: int
    requests: int
    errors: int
    throughput: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    latency_p50: float
    latency_p99: float
    output_tokens_per_s: float = 0.0
    #: Mean tokens per request as the upstream counted them (its ``usage``; 0 if it sent none).
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    ttft_p90: float | None = None
    latency_p90: float | None = None
    #: Mean latency of the successful requests that ended in the window (sizes the next steps).
    mean_latency: float = 0.0
    #: Time-weighted mean cost in flight over the window (as the shim prices requests,
    #: :class:`CostMeter`).
    inflight_cost: float = 0.0
    #: The cost in flight the window's requests stayed at or below 95 % of its time: what a
    #: budget must hold for the level's requests to run together as they did here.
    inflight_cost_high: float = 0.0
    #: Seconds of steady window the throughput was counted over (0: not windowed).
    window: float = 0.0
    #: The engine's own queue over the window: the median of its ``vllm:num_requests_waiting``
    #: sampled in it (None: the upstream exposes no such metric).
    engine_waiting: float | None = None
    #: The median of its ``vllm:num_requests_running`` over the window (None: not exposed).
    engine_running: float | None = None

    @property
    def engine_queued(self) -> bool:
        """The engine kept requests waiting for a slot over this window (rule 1b)."""
        return self.engine_waiting is not None and self.engine_waiting > 0

    @property
    def error_ratio(self) -> float:
        total = self.requests + self.errors
        return self.errors / total if total else 1.0


@dataclass(frozen=True)
class KneeRule:
    ttft_slo: float
    tpot_slo: float | None = None
    max_error_ratio: float = 0.01
    tolerance: float = 0.05
    gain: float = 0.05
    min_repeats: int = 2
    max_repeats: int = 4
    refine: int = 2
    #: Fewest successful requests a measurement of the knee counts for ``high`` confidence.
    min_requests: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ttft_slo) and self.ttft_slo > 0):
            raise KneeInputError(f"ttft_slo must be a positive number of seconds, got {self.ttft_slo!r}")
        if self.tpot_slo is not None and not (math.isfinite(self.tpot_slo) and self.tpot_slo > 0):
            raise KneeInputError(f"tpot_slo must be a positive number of seconds, got {self.tpot_slo!r}")
        if not 0 <= self.max_error_ratio < 1:
            raise KneeInputError(f"max_error_ratio must be in [0, 1), got {self.max_error_ratio!r}")
        for name in ("tolerance", "gain"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise KneeInputError(f"{name} must be in [0, 1), got {value!r}")
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise KneeInputError(
                f"expected 1 <= min_repeats <= max_repeats, got {self.min_repeats}, {self.max_repeats}"
            )
        if self.refine < 0:
            raise KneeInputError(f"refine must be >= 0, got {self.refine!r}")
        if self.min_requests < 1:
            raise KneeInputError(f"min_requests must be >= 1, got {self.min_requests!r}")


@dataclass(frozen=True)
class Verdict:
    """How one level fares under the rule, on the median of its measurements."""

    concurrency: int
    runs: int
    throughput: float
    ttft_p99: float
    tpot_p99: float
    within_slo: bool
    errors_ok: bool
    #: Measurements whose own verdict (SLO met or not) differs from the median's.
    disagreeing: int
    #: (max - min) / median of the throughputs measured; 0 for one measurement.
    spread: float
    #: Some request succeeded (on the median measurement).
    working: bool = True
    #: The fewest successful requests any one measurement counted.
    fewest_requests: int = 0
    #: Medians over the measurements of the engine's waiting and running requests (None: the
    #: upstream exposes no such metrics); ``queued``: the engine kept a queue (rule 1b).
    engine_waiting: float | None = None
    engine_running: float | None = None
    queued: bool = False

    @property
    def good(self) -> bool:
        return self.within_slo and self.errors_ok and not self.queued


@dataclass(frozen=True)
class Knee:
    """``level`` is the knee (None: no level meets the SLO); ``limit`` says what bounded it."""

    level: int | None
    limit: Limit | None
    verdicts: tuple[Verdict, ...]
    reason: str
    best_throughput: float = 0.0
    confidence: Confidence = "low"

    def verdict(self, level: int) -> Verdict | None:
        return next((v for v in self.verdicts if v.concurrency == level), None)


@dataclass(frozen=True)
class Recommendation:
    """``max_queue_wait``: the interactive class's queue wait; ``batch_max_queue_wait``: the
    batch class's hold (None: not held, every class shares the interactive wait). Queue bounds
    are the shim's own (each class what the engine drains within its wait)."""

    max_concurrency: int
    max_queue_wait: float
    batch_max_queue_wait: float | None = None
    #: ``--retry-after-max`` (None: the shim's default).
    retry_after_max: float | None = None
    #: ``--max-inflight-tokens``, the cost budget (None: the request-count cap alone).
    max_inflight_tokens: int | None = None

    def serve_flags(self) -> list[str]:
        flags = ["--max-concurrency", str(self.max_concurrency)]
        flags += ["--max-queue-wait", f"{self.max_queue_wait:g}"]
        if self.batch_max_queue_wait is not None:
            flags += ["--class-max-queue-wait", f"batch={self.batch_max_queue_wait:g}"]
        if self.retry_after_max is not None:
            flags += ["--retry-after-max", f"{self.retry_after_max:g}"]
        if self.max_inflight_tokens is not None:
            flags += ["--max-inflight-tokens", str(self.max_inflight_tokens)]
        return flags


Runs = Mapping[int, Sequence[StepStats]]


def _validate(step: StepStats) -> None:
    if step.concurrency < 1:
        raise KneeInputError(f"concurrency must be >= 1, got {step.concurrency}")
    if step.requests < 0 or step.errors < 0:
        raise KneeInputError(f"negative request count at concurrency {step.concurrency}")
    for name in (
        "throughput",
        "ttft_p50",
        "ttft_p99",
        "itl_p50",
        "itl_p99",
        "latency_p50",
        "latency_p99",
        "output_tokens_per_s",
        "mean_prompt_tokens",
        "mean_output_tokens",
    ):
        value = getattr(step, name)
        if not (math.isfinite(value) and value >= 0):
            raise KneeInputError(f"{name} at concurrency {step.concurrency} must be >= 0, got {value!r}")
    for name in ("engine_waiting", "engine_running"):
        value = getattr(step, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise KneeInputError(f"{name} at concurrency {step.concurrency} must be >= 0, got {value!r}")


def rate(step: StepStats) -> float:
    """The throughput the rule compares: answer tokens/s, else requests/s."""
    return step.output_tokens_per_s if step.output_tokens_per_s > 0 else step.throughput


def _meets(step: StepStats, rule: KneeRule) -> bool:
    return (
        step.requests > 0
        and not step.engine_queued
        and step.ttft_p99 <= rule.ttft_slo
        and (rule.tpot_slo is None or step.itl_p99 <= rule.tpot_slo)
        and step.error_ratio <= rule.max_error_ratio
    )


def judge_level(level: int, steps: Sequence[StepStats], rule: KneeRule) -> Verdict:
    """The verdict on one level from all its measurements (at least one)."""
    if not steps:
        raise KneeInputError(f"no measurement at concurrency {level}")
    for step in steps:
        _validate(step)
    rates = [rate(s) for s in steps]
    median_rate = statistics.median(rates)
    ttft = statistics.median(s.ttft_p99 for s in steps)
    tpot = statistics.median(s.itl_p99 for s in steps)
    errors_ok = statistics.median(s.error_ratio for s in steps) <= rule.max_error_ratio
    working = statistics.median(s.requests for s in steps) > 0
    within = (
        working and ttft <= rule.ttft_slo and (rule.tpot_slo is None or tpot <= rule.tpot_slo) and errors_ok
    )
    waiting = _median_known([s.engine_waiting for s in steps])
    queued = waiting is not None and waiting > 0
    disagreeing = sum(1 for s in steps if _meets(s, rule) != (within and not queued))
    spread = (max(rates) - min(rates)) / median_rate if median_rate > 0 and len(rates) > 1 else 0.0
    return Verdict(
        level,
        len(steps),
        median_rate,
        ttft,
        tpot,
        within,
        errors_ok,
        disagreeing,
        spread,
        working,
        min(s.requests for s in steps),
        waiting,
        _median_known([s.engine_running for s in steps]),
        queued,
    )


def _median_known(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(statistics.median(known)) if known else None


def judge(runs: Runs, rule: KneeRule) -> tuple[Verdict, ...]:
    """One verdict per measured level, by concurrency.

    When even the lowest level measured kept a queue inside the engine, the queue is not the
    ramp's doing (another client's traffic, or levels that start past the engine's slots):
    rule 1b is then waived and the SLOs alone judge, as for an engine without the metrics."""
    verdicts = tuple(judge_level(level, runs[level], rule) for level in sorted(runs) if runs[level])
    if verdicts and verdicts[0].queued:
        waived = tuple(replace(v, queued=False) for v in verdicts)
        return tuple(
            replace(v, disagreeing=sum(1 for s in runs[v.concurrency] if _meets_slo(s, rule) != v.good))
            for v in waived
        )
    return verdicts


def _meets_slo(step: StepStats, rule: KneeRule) -> bool:
    return _meets(replace(step, engine_waiting=None), rule)


def queue_waived(verdicts: Sequence[Verdict]) -> bool:
    """Rule 1b was waived: the lowest level measured already found the engine queueing."""
    return bool(verdicts) and verdicts[0].engine_waiting is not None and verdicts[0].engine_waiting > 0


def _rising(verdicts: Sequence[Verdict], index: int, gain: float) -> bool:
    """Whether level ``index`` beat every lower level's throughput by more than ``gain``."""
    if index == 0:
        return verdicts[0].throughput > 0
    below = max(v.throughput for v in verdicts[:index])
    return verdicts[index].throughput > below * (1 + gain)


def climbing(verdicts: Sequence[Verdict], rule: KneeRule) -> bool:
    """Rule 4: the top level is within the SLO and it, or the one below, still added throughput."""
    if not verdicts or not verdicts[-1].good:
        return False
    top = len(verdicts) - 1
    return _rising(verdicts, top, rule.gain) or (top > 0 and _rising(verdicts, top - 1, rule.gain))


def find_knee(runs: Runs, rule: KneeRule) -> Knee:
    """Rule 3 on the measurements so far (confidence is :func:`next_level`'s to settle)."""
    verdicts = judge(runs, rule)
    if not verdicts:
        return Knee(None, None, verdicts, "no level was measured")
    good = [v for v in verdicts if v.good]
    if not good:
        return Knee(None, None, verdicts, _no_knee_reason(verdicts, rule))
    # Only levels below the first SLO miss count: TTFT does not come back under the SLO
    # as load grows, so a pass above a miss is noise.
    first_miss = next((v.concurrency for v in verdicts if not v.good), math.inf)
    good = [v for v in good if v.concurrency < first_miss]
    if not good:
        return Knee(None, None, verdicts, _no_knee_reason(verdicts, rule))
    best = max(v.throughput for v in good)
    knee = next(v for v in good if v.throughput >= best * (1 - rule.tolerance))
    above = next((v for v in verdicts if v.concurrency > knee.concurrency), None)
    limit: Limit
    if above is None:
        limit = "max_level"
        reason = f"no knee up to concurrency {knee.concurrency}, the highest level measured"
    elif above.queued:
        limit = "engine_queue"
        reason = f"concurrency {above.concurrency} {_queue_text(above)}"
        if not (above.within_slo and above.errors_ok):
            reason += f", and misses the SLO ({_miss(above, rule)})"
    elif not above.good:
        limit = "slo"
        reason = f"concurrency {above.concurrency} misses the SLO ({_miss(above, rule)})"
    else:
        limit = "plateau"
        gained = above.throughput / knee.throughput - 1 if knee.throughput > 0 else 0.0
        reason = (
            f"concurrency {above.concurrency} adds {gained:+.0%} throughput over {knee.concurrency} "
            f"(within the {rule.tolerance:.0%} tolerance): the engine is full"
        )
    return Knee(knee.concurrency, limit, verdicts, reason, best)


def _queue_text(v: Verdict) -> str:
    running = "" if v.engine_running is None else f" beside {v.engine_running:g} running"
    return (
        f"kept {v.engine_waiting or 0:g} requests waiting inside the engine (median{running}), where the "
        "shim's classes do not count"
    )


def engine_slots(v: Verdict) -> int | None:
    """The engine's slots as a level that kept a queue shows them: its median running."""
    if not v.queued or v.engine_running is None or v.engine_running < 1:
        return None
    return math.floor(v.engine_running)


def _miss(v: Verdict, rule: KneeRule) -> str:
    parts = []
    if v.ttft_p99 > rule.ttft_slo:
        parts.append(f"TTFT p99 {v.ttft_p99:.3f} s > {rule.ttft_slo:g} s")
    if rule.tpot_slo is not None and v.tpot_p99 > rule.tpot_slo:
        parts.append(f"TPOT p99 {v.tpot_p99 * 1000:.1f} ms > {rule.tpot_slo * 1000:g} ms")
    if not v.errors_ok:
        parts.append(f"errors over {rule.max_error_ratio:.0%}")
    if v.queued and not parts:
        parts.append(_queue_text(v))
    return ", ".join(parts) or "no request succeeded"


def _no_knee_reason(verdicts: Sequence[Verdict], rule: KneeRule) -> str:
    lowest = verdicts[0]
    if not lowest.working:
        return f"every request failed at concurrency {lowest.concurrency}"
    return (
        f"concurrency {lowest.concurrency}, the lowest level measured, already misses the SLO "
        f"({_miss(lowest, rule)}): no cap meets it; shorten prompts, add capacity or relax the SLO"
    )


@dataclass(frozen=True)
class Plan:
    """What to do next: measure ``level`` (why: ``purpose``), or stop (``level`` None)."""

    level: int | None
    purpose: str


def next_level(runs: Runs, ramp: Sequence[int], rule: KneeRule, history: Sequence[int | None] = ()) -> Plan:
    """The next measurement of a ramp over ``ramp`` (increasing levels), rules 4 and 5.

    ``history`` is the knee found after each earlier measurement (oldest first); the
    caller appends :func:`find_knee`'s level after every measurement.
    """
    verdicts = judge(runs, rule)
    measured = [v.concurrency for v in verdicts]
    if not verdicts:
        return Plan(ramp[0], "climb") if ramp else Plan(None, "nothing to measure")
    if climbing(verdicts, rule):
        higher = [level for level in ramp if level > measured[-1]]
        if higher:
            return Plan(higher[0], "climb")
    knee = find_knee(runs, rule)
    if knee.level is None:
        if verdicts[0].runs < rule.min_repeats:
            return Plan(verdicts[0].concurrency, "repeat: the lowest level misses the SLO")
        return Plan(None, "no level meets the SLO")
    above = next((level for level in measured if level > knee.level), None)
    if above is not None and knee.limit in ("slo", "engine_queue") and rule.refine > 0:
        midpoint = (knee.level + above) // 2
        why = f"refine between {knee.level} and {above}"
        above_verdict = knee.verdict(above)
        slots = engine_slots(above_verdict) if above_verdict is not None else None
        if knee.limit == "engine_queue" and slots is not None:
            # The level above ran ``slots`` at once and queued the rest: the engine's slots are
            # the highest level that can run without a queue, measured next (none above the knee).
            midpoint = slots if slots > knee.level else knee.level
            why = f"refine: {above} ran {slots} at once inside the engine"
        # At most ``refine`` levels off the ramp between two ramp levels.
        floor = max((level for level in ramp if level <= knee.level), default=0)
        refined = sum(1 for level in measured if floor < level < above and level not in ramp)
        if knee.level < midpoint < above and midpoint not in runs and refined < rule.refine:
            return Plan(midpoint, why)
    for level in (knee.level, above):
        if level is not None and len(runs[level]) < rule.min_repeats:
            return Plan(level, "repeat next to the knee")
    for level in (knee.level, above):
        v = knee.verdict(level) if level is not None else None
        if v is not None and v.disagreeing and v.runs < min(3, rule.max_repeats):
            # Two measurements that disagree are a tie: a third one makes the median a real one.
            return Plan(v.concurrency, "repeat: measurements disagree")
        if v is not None and v.spread > 2 * rule.tolerance and v.runs < rule.max_repeats:
            # Throughputs this far apart cannot tell the knee from the level above it.
            return Plan(v.concurrency, "repeat: throughputs spread")
    if stable(history, knee.level, rounds=2):
        return Plan(None, "stable")
    for level in (knee.level, above):
        if level is not None and len(runs[level]) < rule.max_repeats:
            return Plan(level, "repeat: the knee moved")
    return Plan(None, "repeats exhausted")


def stable(history: Sequence[int | None], knee: int | None, rounds: int) -> bool:
    """The knee was ``knee`` after each of the last ``rounds`` measurements."""
    return len(history) >= rounds and all(h == knee for h in history[-rounds:])


def confidence(knee: Knee, history: Sequence[int | None], rule: KneeRule) -> tuple[Confidence, str]:
    """Rule 6, with a sentence saying why."""
    if knee.level is None:
        return "low", "no knee"
    v = knee.verdict(knee.level)
    if v is None:  # pragma: no cover - the knee is one of the verdicts
        return "low", "no verdict at the knee"
    if v.runs < 2:
        return "low", f"concurrency {knee.level} was measured once"
    if not stable(history, knee.level, rounds=2):
        return "low", "the knee still moved on the last measurement"
    above = next((u for u in knee.verdicts if u.concurrency > knee.level), None)
    # Doubt about a level above within REPRODUCIBLE of the knee cannot move the
    # recommendation by more than that: it does not lower the confidence.
    near = above is not None and above.concurrency <= knee.level * (1 + REPRODUCIBLE)
    neighbours = [x for x in (v, None if near else above) if x is not None]
    flipped = sum(x.disagreeing for x in neighbours)
    spread = max(x.spread for x in neighbours)
    if flipped:
        return "medium", f"{flipped} measurement(s) next to the knee disagreed with the SLO verdict"
    if spread > 2 * rule.tolerance:
        return "medium", f"throughput next to the knee spread by {spread:.0%} between measurements"
    fewest = min(x.fewest_requests for x in neighbours)
    if fewest < rule.min_requests:
        return (
            "medium",
            f"a measurement next to the knee counted only {fewest} requests (< {rule.min_requests})",
        )
    why = (
        f"{v.runs} measurements of {knee.level} agree (throughput spread {spread:.0%} next to the knee, "
        f"at most {2 * rule.tolerance:.0%}) and the knee held"
    )
    if near and above is not None and (above.disagreeing or above.spread > 2 * rule.tolerance):
        why += (
            f"; {above.concurrency} above it, within {REPRODUCIBLE:.0%}, measured unevenly: the knee is "
            f"{knee.level} or {above.concurrency}"
        )
    return "high", why


def with_confidence(knee: Knee, history: Sequence[int | None], rule: KneeRule) -> tuple[Knee, str]:
    """``knee`` with its confidence set, and the sentence that explains it."""
    level, why = confidence(knee, history, rule)
    return Knee(knee.level, knee.limit, knee.verdicts, knee.reason, knee.best_throughput, level), why


def recommend(
    runs: Sequence[StepStats],
    ttft_slo: float,
    batch_wait: float | None = BATCH_QUEUE_WAIT,
    *,
    inflight_budget: int | None = None,
    interactive_budget: float = INTERACTIVE_BUDGET,
) -> Recommendation:
    """Shim settings for the knee level, from its measurements (see the module doc);
    ``batch_wait`` None: batch is not held (it shares the interactive queue's bounds);
    ``inflight_budget``: the cost budget measured at the knee, recommended as
    ``--max-inflight-tokens`` beside the request cap; ``interactive_budget``: the seconds chat
    callers give a call to start (the interactive queue's wait is what it leaves)."""
    if not (math.isfinite(ttft_slo) and ttft_slo > 0):
        raise KneeInputError(f"ttft_slo must be a positive number of seconds, got {ttft_slo!r}")
    if batch_wait is not None and not (math.isfinite(batch_wait) and batch_wait > 0):
        raise KneeInputError(f"batch_wait must be a positive number of seconds, got {batch_wait!r}")
    if not runs:
        raise KneeInputError("no measurement of the knee level")
    level = runs[0].concurrency
    ttft = statistics.median(s.ttft_p99 for s in runs)
    throughput = statistics.median(s.throughput for s in runs)
    if ttft > ttft_slo or throughput <= 0:
        raise KneeInputError(f"the step at concurrency {level} does not meet the SLO")
    if not (math.isfinite(interactive_budget) and interactive_budget > 0):
        raise KneeInputError(
            f"interactive_budget must be a positive number of seconds, got {interactive_budget!r}"
        )
    headroom = interactive_budget - ttft
    wait = max(MIN_QUEUE_WAIT, math.floor(headroom * 100 + 1e-9) / 100)
    if inflight_budget is not None and inflight_budget < 1:
        raise KneeInputError(f"inflight_budget must be >= 1, got {inflight_budget!r}")
    if batch_wait is None:
        return Recommendation(level, wait, max_inflight_tokens=inflight_budget)
    return Recommendation(
        level,
        wait,
        batch_max_queue_wait=batch_wait,
        retry_after_max=HELD_RETRY_AFTER_MAX,
        max_inflight_tokens=inflight_budget,
    )


# -- the samples ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it. Times are clock readings, seconds.

    ``first_token`` is None for a failed request or an answer without content;
    ``itl`` is the request's mean gap between tokens after the first (None below two);
    ``token_times`` the arrival of each chunk that carried answer text; ``cost`` what the
    shim's cost cap counts for it (:class:`CostMeter`). ``done``
    False: a request still running when its level's window closed, ``end`` that moment.
    """

    worker: int
    seq: int
    start: float
    end: float
    ok: bool
    first_token: float | None = None
    itl: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    cost: int = 0
    token_times: tuple[float, ...] = ()
    done: bool = True


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method: between the two nearest ranks of
    ``(n - 1) * q / 100``); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(float(v) for v in values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tokens_in(sample: Sample, low: float, high: float) -> float:
    """Answer tokens of ``sample`` that arrived in ``(low, high]``.

    Each streamed chunk's arrival time is kept; when the upstream's ``usage`` counted
    more tokens than chunks (several tokens per chunk), each chunk weighs its share.
    """
    times = sample.token_times
    if not times:
        return 0.0
    weight = sample.output_tokens / len(times) if sample.done and sample.output_tokens > len(times) else 1.0
    return weight * sum(1 for t in times if low < t <= high)


def _overlap(sample: Sample, low: float, high: float) -> float:
    return max(0.0, min(sample.end, high) - max(sample.start, low))


#: The share of the time a budget holds the cost in flight (:attr:`StepStats.inflight_cost_high`,
#: :meth:`SlotCost.quantile`).
COST_QUANTILE = 0.95


def cost_quantile(samples: Sequence[Sample], low: float, high: float, q: float = COST_QUANTILE) -> float:
    """The cost in flight that the requests in ``samples`` stayed at or below for ``q`` of the
    window ``(low, high]``'s time (0 for an empty window)."""
    steps: dict[float, int] = {}
    for s in samples:
        start, end = max(s.start, low), min(s.end, high)
        if end > start and s.cost:
            steps[start] = steps.get(start, 0) + s.cost
            steps[end] = steps.get(end, 0) - s.cost
    if high <= low or not steps:
        return 0.0
    level, at, spans = 0, low, []
    for t in sorted(steps):
        spans.append((level, t - at))
        level, at = level + steps[t], t
    spans.append((level, high - at))
    spans.sort()
    covered, need = 0.0, q * (high - low)
    for cost, seconds in spans:
        covered += seconds
        if covered >= need:
            return float(cost)
    return float(spans[-1][0])


def summarize(
    concurrency: int, samples: Sequence[Sample], *, level_start: float, window: tuple[float, float]
) -> StepStats:
    """The statistics of one level from its steady window ``(low, high]`` (clock readings).

    ``samples`` holds every request that overlaps the window: finished ones, and the ones
    still running when it closed (``done`` False, ``end`` the closing time). The window
    opens once the level has turned over (see :mod:`llm_backoff_shim.lab.calibrate.run`),
    so its ramp-in (requests carried in from the level before, the burst of new workers)
    is not in it.

    - Throughput counts what happened inside the window: requests/s is the requests that
      *ended* in it over its length; answer tokens/s the tokens that *arrived* in it,
      running requests' included. Neither depends on how long a request is compared with
      the window, so a level where a request outlasts the window is measured as well as
      one of short requests.
    - Latency figures (TTFT, TPOT, latency) are of the requests that ended in the window
      and started at this level, leaving out each worker's first request (its start is the
      burst that opens a level); with none such, of every request that ended in it.
    - ``inflight_cost``: the time-weighted mean of the in-flight requests' cost
      (as the shim prices it, :class:`CostMeter`) over the window;
      ``inflight_cost_high``: the cost they stayed at or below for 95 % of it
      (:func:`cost_quantile`).
    """
    low, high = window
    length = high - low
    ended = [s for s in samples if s.done and low < s.end <= high]
    errors = sum(1 for s in ended if not s.ok)
    ok = [s for s in ended if s.ok]
    if length <= 0 or not ok:
        return StepStats(
            concurrency, 0, errors, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, window=max(0.0, length)
        )
    judged = [s for s in ok if s.start >= level_start and s.seq > 0] or ok
    latencies = [s.end - s.start for s in judged]
    ttfts = [(s.first_token if s.first_token is not None else s.end) - s.start for s in judged]
    itls = [s.itl for s in judged if s.itl is not None]
    tokens = sum(tokens_in(s, low, high) for s in samples if s.ok or not s.done)
    cost = sum(s.cost * _overlap(s, low, high) for s in samples) / length
    return StepStats(
        concurrency=concurrency,
        requests=len(ok),
        errors=errors,
        throughput=len(ok) / length,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        latency_p50=percentile(latencies, 50),
        latency_p99=percentile(latencies, 99),
        output_tokens_per_s=tokens / length,
        mean_prompt_tokens=statistics.fmean([s.prompt_tokens for s in ok]),
        mean_output_tokens=statistics.fmean([s.output_tokens for s in ok]),
        ttft_p90=percentile(ttfts, 90),
        latency_p90=percentile(latencies, 90),
        mean_latency=statistics.fmean([s.end - s.start for s in ok]),
        inflight_cost=cost,
        inflight_cost_high=cost_quantile(samples, low, high),
        window=length,
    )


# -- the cost ------------------------------------------------------------------------------

#: The class calibrate's requests are learned under (it sends one class).
CLASS = "calibrate"


class CostMeter:
    """Prices calibrate's requests as the shim does (module docstring), learning the answers as
    they end; ``prior``: the answer length assumed before enough have ended (the mix's mean)."""

    def __init__(self, clock: Clock, prior: int) -> None:
        self.answers = AnswerLengths((CLASS,), clock)
        self.prior = max(0, prior)

    def answer(self) -> int:
        """The answer tokens a request is priced at now."""
        return self.answers.expected(CLASS, None, self.prior)

    def cost(self, prompt_tokens: int) -> int:
        """A request's cost: its prompt tokens plus :meth:`answer`."""
        return max(0, prompt_tokens) + self.answer()

    def observe(self, completion_tokens: int) -> None:
        """A request ended with ``completion_tokens`` of answer."""
        self.answers.observe(CLASS, completion_tokens)


def budget_tokens(inflight_cost: float) -> int:
    """The recommended ``--max-inflight-tokens``: the knee's in-flight cost (module docstring),
    rounded up to a multiple of 64 tokens (finer than any request's cost varies, coarser than noise)."""
    if not (math.isfinite(inflight_cost) and inflight_cost > 0):
        raise ValueError(f"expected a positive in-flight cost, got {inflight_cost!r}")
    return 64 * math.ceil(inflight_cost / 64)


@dataclass(frozen=True)
class SlotCost:
    """What one slot's request of the mix costs: the mean and standard deviation over the mix
    (module docstring), from ``requests`` completed requests."""

    mean: float
    sd: float
    requests: int

    def quantile(self, slots: int, q: float = COST_QUANTILE) -> float:
        """The cost ``slots`` such requests hold together at or below with probability ``q``:
        their sum taken as normal."""
        if slots < 1 or not 0 < q < 1:
            raise ValueError(f"expected slots >= 1 and 0 < q < 1, got {slots!r}, {q!r}")
        return slots * self.mean + NormalDist().inv_cdf(q) * math.sqrt(slots) * self.sd


def slot_cost(
    chat_prompts: Sequence[int], long_prompts: Sequence[int], long_share: float, answer: int
) -> SlotCost | None:
    """One slot's cost over the mix: a long-prompt request with probability ``long_share``, its
    prompt tokens one of ``long_prompts`` at random, else a chat one of ``chat_prompts``; each
    priced at ``answer`` answer tokens. A kind with no completed request is left out (the other
    takes its share); None when neither has one."""
    if not 0 <= long_share <= 1:
        raise ValueError(f"expected 0 <= long_share <= 1, got {long_share!r}")
    kinds = [(1 - long_share, chat_prompts), (long_share, long_prompts)]
    kinds = [(share, prompts) for share, prompts in kinds if share > 0 and prompts]
    if not kinds:
        return None
    total = sum(share for share, _ in kinds)
    answer = max(0, answer)
    mean = second = 0.0
    for share, prompts in kinds:
        w = share / total
        m = statistics.fmean(prompts) + answer
        mean += w * m
        second += w * (statistics.pvariance(prompts, statistics.fmean(prompts)) + m * m)
    sd = math.sqrt(max(0.0, second - mean * mean))
    return SlotCost(mean, sd, sum(len(prompts) for _, prompts in kinds))
