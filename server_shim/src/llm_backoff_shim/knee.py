"""Where to cap concurrency: the knee of a load ramp, and the shim settings it implies (pure).

Input: one :class:`StepStats` per concurrency level of a closed-loop ramp (what
``llm-backoff-shim calibrate`` measures). Output: a :class:`Knee` and, when there is
one, a :class:`Recommendation` for ``llm-backoff-shim serve``.

The rule, exactly:

1. Between two consecutive steps ``a`` -> ``b`` the *elasticity* of a latency ``L``
   with respect to throughput ``X`` (completed requests per second) is
   ``ln(L_b / L_a) / ln(X_b / X_a)``: 0 if the latency did not grow, ``inf`` if it
   grew while throughput did not. It is taken for the end-to-end request latency and
   for TTFT (raised to ``latency_floor``, 20 ms by default, so jitter on a tiny TTFT is
   not growth), each at p99 and, when measured, at p90: a latency counts as growing
   faster than throughput only if its p99 and its p90 both do (the smaller of the
   two). The step's elasticity ``E`` is the larger of the two latencies'. ``E <= 1``:
   the extra concurrency bought at least as much throughput as it cost in latency.
   ``E > 1``: latency now grows faster than throughput.
2. A step *ends the efficient region* when its elasticity exceeds
   ``max_elasticity`` (default 1) or more than ``max_error_ratio`` of its requests
   failed (an upstream that sheds load, e.g. vLLM's 503 "queue full", is past
   capacity whatever its latency says).
3. The knee is the highest-concurrency step *before* the first step that ends the
   efficient region whose p99 TTFT is within the SLO and whose errors are within
   ``max_error_ratio``. No such step: no knee, no recommendation (the SLO cannot be
   met even at the lowest level measured).

Why the p90 next to the p99: with a few dozen requests per step the p99 is nearly the
maximum, and one request delayed by a busy client machine would fake a knee. A tail
worth acting on holds a tenth of the requests or more and moves the p90 too: one
worker over the engine's slots at 9 workers for 8 slots already does, while the
median barely moves, which is why the median is not the confirmation.

Why two latencies: below capacity vLLM's TTFT barely moves while its inter-token
latency grows with the batch, which only the whole request's latency shows; once
requests queue for a slot, TTFT (queue wait + prefill) climbs first and most, and
with levels far apart (4 -> 8 around 6 slots) the end-to-end latency alone can still
look worth it. In a closed loop with no think time Little's law gives
``X = N / mean latency``, so an end-to-end ``E > 1`` at a doubling of ``N`` means
throughput grew by less than ``sqrt(2)``. The SLO itself is the hard constraint: the
knee never has a p99 TTFT above it.

The recommendation at knee step ``K`` with SLO ``S`` (seconds, p99 TTFT):

- ``max_concurrency = K.concurrency``: the last level measured before latency started
  to outgrow throughput (the issue's "just under the knee"); a finer ``--steps`` list
  around it narrows the gap to the true knee.
- ``max_queue_wait = S - K.ttft_p99`` (floored to 10 ms, at least 10 ms): a request
  admitted after waiting that long still gets its first token within the SLO, since
  once admitted it sees the knee's TTFT. Waiting longer would only miss the SLO late.
- ``max_queue = floor(K.throughput * max_queue_wait)``, at least 1: what the engine
  drains within that wait. One slot even without headroom, because a queue of zero
  turns every momentary gap between a completion and the next admission into a 429.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

#: What bounded the knee: the next step saturated, failed, missed the SLO, or was never measured.
Limit = Literal["saturation", "errors", "slo", "max_level"]

#: Smallest ``--max-queue-wait`` recommended (the shim needs a positive wait).
MIN_QUEUE_WAIT = 0.01


class KneeInputError(ValueError):
    """Step measurements the knee finder cannot work with (unsorted, negative, NaN...)."""


@dataclass(frozen=True)
class StepStats:
    """One concurrency level of a closed-loop ramp. Times in seconds.

    ``requests`` counts successful requests that entered the statistics; with none, the
    latency fields are 0 and ``throughput`` is 0.
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
    #: p90s confirm that a p99 rise is a tail, not one slow request; None: not measured.
    ttft_p90: float | None = None
    latency_p90: float | None = None

    @property
    def error_ratio(self) -> float:
        total = self.requests + self.errors
        return self.errors / total if total else 1.0


@dataclass(frozen=True)
class KneeRule:
    ttft_slo: float
    max_elasticity: float = 1.0
    max_error_ratio: float = 0.01
    latency_floor: float = 0.02

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ttft_slo) and self.ttft_slo > 0):
            raise KneeInputError(f"ttft_slo must be a positive number of seconds, got {self.ttft_slo!r}")
        if not (math.isfinite(self.max_elasticity) and self.max_elasticity > 0):
            raise KneeInputError(f"max_elasticity must be a positive number, got {self.max_elasticity!r}")
        if not 0 <= self.max_error_ratio < 1:
            raise KneeInputError(f"max_error_ratio must be in [0, 1), got {self.max_error_ratio!r}")
        if not (math.isfinite(self.latency_floor) and self.latency_floor >= 0):
            raise KneeInputError(f"latency_floor must be a number >= 0, got {self.latency_floor!r}")


@dataclass(frozen=True)
class Verdict:
    """How one step fares under the rule. ``elasticity`` is None for the first step."""

    concurrency: int
    elasticity: float | None
    within_slo: bool
    errors_ok: bool
    saturated: bool

    @property
    def good(self) -> bool:
        """Within the SLO, few errors, not saturated: the ramp may go on."""
        return self.within_slo and self.errors_ok and not self.saturated


@dataclass(frozen=True)
class Knee:
    """``step`` is the knee (None: no level meets the SLO); ``limit`` says what bounded it."""

    step: StepStats | None
    limit: Limit | None
    verdicts: tuple[Verdict, ...]
    reason: str


@dataclass(frozen=True)
class Recommendation:
    max_concurrency: int
    max_queue: int
    max_queue_wait: float

    def serve_flags(self) -> list[str]:
        return [
            "--max-concurrency",
            str(self.max_concurrency),
            "--max-queue",
            str(self.max_queue),
            "--max-queue-wait",
            f"{self.max_queue_wait:g}",
        ]


def _log_ratio_elasticity(
    latency_a: float, latency_b: float, throughput_a: float, throughput_b: float
) -> float:
    latency_growth = math.log(latency_b / latency_a)
    if latency_growth <= 0:
        return 0.0
    throughput_growth = math.log(throughput_b / throughput_a)
    if throughput_growth <= 0:
        return math.inf
    return latency_growth / throughput_growth


def elasticity(before: StepStats, after: StepStats, latency_floor: float = 0.02) -> float:
    """Latency/throughput elasticity from ``before`` to ``after`` (rule 1 of the module doc)."""
    if after.requests == 0 or after.throughput <= 0 or after.latency_p99 <= 0:
        return math.inf
    if before.requests == 0 or before.throughput <= 0 or before.latency_p99 <= 0:
        # Nothing to compare with: the earlier step failed, so this one is judged on its own.
        return 0.0
    floor = max(latency_floor, 1e-9)

    def of(latency_a: float, latency_b: float, *, lowest: float = 1e-9) -> float:
        return _log_ratio_elasticity(
            max(latency_a, lowest), max(latency_b, lowest), before.throughput, after.throughput
        )

    def tail(p90_a: float | None, p90_b: float | None, p99_a: float, p99_b: float, lowest: float) -> float:
        # One slow request in a small sample moves the p99 alone; a tail that matters
        # (a tenth of the requests or more) moves the p90 as well.
        e99 = of(p99_a, p99_b, lowest=lowest)
        if p90_a is None or p90_b is None:
            return e99
        return min(of(p90_a, p90_b, lowest=lowest), e99)

    whole = tail(before.latency_p90, after.latency_p90, before.latency_p99, after.latency_p99, 1e-9)
    first = tail(before.ttft_p90, after.ttft_p90, before.ttft_p99, after.ttft_p99, floor)
    return max(whole, first)


def _validate(steps: Sequence[StepStats]) -> None:
    previous = 0
    for step in steps:
        if step.concurrency <= previous:
            raise KneeInputError(
                f"concurrency levels must be positive and strictly increasing, got {step.concurrency} "
                f"after {previous}"
            )
        previous = step.concurrency
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
            "ttft_p90",
            "latency_p90",
        ):
            value = getattr(step, name)
            if value is None and name.endswith("_p90"):
                continue
            if not (math.isfinite(value) and value >= 0):
                raise KneeInputError(f"{name} at concurrency {step.concurrency} must be >= 0, got {value!r}")


def judge(steps: Sequence[StepStats], rule: KneeRule) -> tuple[Verdict, ...]:
    """One verdict per step, in order (steps sorted by concurrency, validated)."""
    _validate(steps)
    verdicts = []
    for i, step in enumerate(steps):
        e = None if i == 0 else elasticity(steps[i - 1], step, rule.latency_floor)
        verdicts.append(
            Verdict(
                concurrency=step.concurrency,
                elasticity=e,
                within_slo=step.requests > 0 and step.ttft_p99 <= rule.ttft_slo,
                errors_ok=step.error_ratio <= rule.max_error_ratio,
                saturated=e is not None and e > rule.max_elasticity,
            )
        )
    return tuple(verdicts)


def find_knee(steps: Sequence[StepStats], rule: KneeRule) -> Knee:
    """Apply the rule of the module doc to a ramp (may be empty)."""
    verdicts = judge(steps, rule)
    end = next((i for i, v in enumerate(verdicts) if v.saturated or not v.errors_ok), len(steps))
    knee_index = next(
        (i for i in range(end - 1, -1, -1) if verdicts[i].within_slo and verdicts[i].errors_ok), None
    )
    if knee_index is None:
        return Knee(None, None, verdicts, _no_knee_reason(steps, verdicts, end, rule))
    knee = steps[knee_index]
    nxt = knee_index + 1
    limit: Limit
    if nxt == len(steps):
        limit = "max_level"
        reason = (
            f"no knee up to concurrency {knee.concurrency}, the highest level measured: "
            "raise --max-level to look further"
        )
    elif nxt == end and not verdicts[nxt].errors_ok:
        limit = "errors"
        reason = (
            f"{steps[nxt].error_ratio:.0%} of requests failed at concurrency {steps[nxt].concurrency} "
            f"(limit {rule.max_error_ratio:.0%})"
        )
    elif nxt == end:
        limit = "saturation"
        reason = (
            f"from concurrency {knee.concurrency} to {steps[nxt].concurrency} latency grew faster "
            f"than throughput (elasticity {_fmt_e(verdicts[nxt].elasticity)} > {rule.max_elasticity:g})"
        )
    else:
        limit = "slo"
        reason = (
            f"p99 TTFT {steps[nxt].ttft_p99:.3f} s at concurrency {steps[nxt].concurrency} is over "
            f"the {rule.ttft_slo:g} s SLO"
        )
    return Knee(knee, limit, verdicts, reason)


def _fmt_e(value: float | None) -> str:
    return "inf" if value is None or math.isinf(value) else f"{value:.2f}"


def _no_knee_reason(steps: Sequence[StepStats], verdicts: Sequence[Verdict], end: int, rule: KneeRule) -> str:
    if not steps:
        return "no step was measured"
    if end == 0:
        first = steps[0]
        if first.requests == 0:
            return f"every request failed at concurrency {first.concurrency}"
        return (
            f"{first.error_ratio:.0%} of requests failed already at concurrency {first.concurrency} "
            f"(limit {rule.max_error_ratio:.0%})"
        )
    lowest = steps[0]
    return (
        f"p99 TTFT {lowest.ttft_p99:.3f} s is over the {rule.ttft_slo:g} s SLO already at "
        f"concurrency {lowest.concurrency}: no cap meets it; shorten prompts, add capacity or relax "
        "--ttft-slo"
    )


def should_stop(steps: Sequence[StepStats], rule: KneeRule) -> bool:
    """True once the last step is past the knee (saturated, failing or over the SLO).

    Higher levels could only add load: the knee cannot lie beyond a saturated or
    failing step, and TTFT does not come back under the SLO as load grows.
    """
    return bool(steps) and not judge(steps, rule)[-1].good


def recommend(knee: StepStats, ttft_slo: float) -> Recommendation:
    """Shim settings for a knee step (see the module doc for the formulas)."""
    if not (math.isfinite(ttft_slo) and ttft_slo > 0):
        raise KneeInputError(f"ttft_slo must be a positive number of seconds, got {ttft_slo!r}")
    if knee.requests == 0 or knee.ttft_p99 > ttft_slo:
        raise KneeInputError(f"the step at concurrency {knee.concurrency} does not meet the SLO")
    headroom = ttft_slo - knee.ttft_p99
    wait = max(MIN_QUEUE_WAIT, math.floor(headroom * 100 + 1e-9) / 100)
    queue = max(1, math.floor(knee.throughput * wait + 1e-9))
    return Recommendation(max_concurrency=knee.concurrency, max_queue=queue, max_queue_wait=wait)
