"""Property-based tests (hypothesis) of the SDK's pure parts: hints, backoff, the retry state, buckets.

Fake clocks only; no sockets, no sleeps. ``max_examples`` is kept modest for CI time.
"""

from __future__ import annotations

import email.utils
import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backoff.attempts import GiveUp, Retry, RetryState
from llm_backoff.backoff import computed_backoff, next_wait
from llm_backoff.classify import Verdict
from llm_backoff.errors import RateLimitTimeout
from llm_backoff.policy import RetryPolicy
from llm_backoff.ratelimit import TokenBucket
from llm_backoff.retry_after import hint_from_body, parse_delay_seconds, parse_hint, parse_http_date

NOW = 1_700_000_000.0
FEW = settings(max_examples=100, deadline=None)


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- Retry-After parsing over arbitrary input ---------------------------------------------


@FEW
@given(st.text(max_size=60))
def test_delay_seconds_of_any_text_is_none_or_finite_nonnegative(text: str) -> None:
    value = parse_delay_seconds(text)
    assert value is None or (math.isfinite(value) and value >= 0)


@FEW
@given(st.text(max_size=60), st.floats(0, 2e9))
def test_http_date_of_any_text_is_none_or_finite_nonnegative(text: str, now: float) -> None:
    value = parse_http_date(text, now=now)
    assert value is None or (math.isfinite(value) and value >= 0)


@FEW
@given(st.floats(min_value=0, max_value=1e7, allow_nan=False))
def test_a_delay_written_by_a_server_reads_back_exactly(seconds: float) -> None:
    assert parse_delay_seconds(repr(seconds)) == seconds
    hint = parse_hint({"retry-after": repr(seconds)}, wall_clock=lambda: NOW)
    assert hint is not None
    assert hint.seconds == seconds
    assert hint.source == "retry-after"


@FEW
@given(st.integers(min_value=0, max_value=10**7))
def test_an_http_date_reads_back_as_the_delay_to_the_second(delay: int) -> None:
    header = email.utils.formatdate(NOW + delay, usegmt=True)
    hint = parse_hint({"retry-after": header}, wall_clock=lambda: NOW)
    assert hint is not None
    assert hint.source == "retry-after-date"
    assert abs(hint.seconds - delay) < 1.0


@FEW
@given(st.text(max_size=40), st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_retry_after_ms_wins_whatever_retry_after_says(garbage: str, millis: float) -> None:
    hint = parse_hint({"retry-after-ms": repr(millis), "retry-after": garbage}, wall_clock=lambda: NOW)
    assert hint is not None
    assert hint.source == "retry-after-ms"
    assert hint.seconds == millis / 1000.0


@FEW
@given(
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=10),
        lambda children: (
            st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=25), children, max_size=3)
        ),
        max_leaves=10,
    )
)
def test_any_json_body_gives_no_hint_or_a_finite_nonnegative_one(value: object) -> None:
    for body in (
        value,
        {"error": value},
        {"error": {"retry_after_seconds": value}},
        {"retry_after_seconds": value},
    ):
        hint = hint_from_body(body)  # type: ignore[arg-type]
        assert hint is None or (math.isfinite(hint) and hint >= 0)


# -- backoff bounds ---------------------------------------------------------------------------

policies = st.builds(
    lambda base, extra, jitter, rj: RetryPolicy(
        base_delay=base, max_delay=base + extra, jitter=jitter, retry_after_jitter=rj
    ),
    st.floats(0, 10),
    st.floats(0, 100),
    st.sampled_from(["full", "equal", "decorrelated", "none"]),
    st.floats(0, 1),
)


@FEW
@given(
    policies,
    st.integers(0, 10_000),
    st.one_of(st.none(), st.floats(0, 1e4)),
    st.one_of(st.none(), st.floats(0, 1e3)),
    st.integers(0, 2**32),
)
def test_every_wait_is_within_its_bounds(
    policy: RetryPolicy, retry: int, hint: float | None, previous: float | None, seed: int
) -> None:
    wait = next_wait(policy, retry, hint, previous, random.Random(seed))
    assert math.isfinite(wait)
    if hint is not None and hint > 0:
        # A server hint is a floor, with at most retry_after_jitter of it on top.
        assert hint <= wait <= hint * (1 + policy.retry_after_jitter) + 1e-9
    else:
        assert 0.0 <= wait <= policy.max_delay + 1e-9
        if policy.jitter == "equal":
            capped = min(policy.max_delay, policy.base_delay * 2.0 ** min(retry, 60))
            assert wait >= capped / 2 - 1e-9
        if policy.jitter == "decorrelated":
            assert wait >= min(policy.base_delay, policy.max_delay) - 1e-9
    assert computed_backoff(policy, retry, previous, random.Random(seed)) <= policy.max_delay + 1e-9


@FEW
@given(
    st.floats(0.5, 120),
    st.integers(1, 30),
    st.lists(st.tuples(st.floats(0, 5), st.one_of(st.none(), st.floats(0, 20))), min_size=1, max_size=40),
    st.integers(0, 2**32),
)
def test_a_call_never_plans_to_wait_past_its_deadline(
    deadline: float, max_attempts: int, attempts: list[tuple[float, float | None]], seed: int
) -> None:
    """Whatever the servers say, the waits the state machine asks for end before the deadline,
    and it stops at max_attempts."""
    clock = Clock()
    policy = RetryPolicy(deadline=deadline, max_attempts=max_attempts, max_retry_after=15)
    state = RetryState(policy, clock=clock, rng=random.Random(seed))
    made = 0
    for duration, hint in attempts:
        started = clock.now
        clock.now += duration
        made += 1
        decision = state.decide(Verdict(True, "status 503"), attempt_started=started, status=503, hint=hint)
        if isinstance(decision, GiveUp):
            break
        assert isinstance(decision, Retry)
        assert decision.wait >= 0
        assert state.elapsed() + decision.wait < deadline
        if hint is not None and hint > 0:
            assert decision.wait >= hint
        clock.now += decision.wait
    assert made <= max_attempts
    assert state.elapsed() <= deadline + max(d for d, _ in attempts)


# -- token bucket: never more than rate x time + capacity ------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    st.floats(0.1, 100),
    st.floats(1, 50),
    st.lists(
        st.tuples(
            st.sampled_from(["try", "reserve", "reserve_timeout", "refund_last", "charge"]),
            st.floats(0, 1),
            st.floats(0, 3),
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_token_bucket_never_grants_more_than_rate_times_time_plus_capacity(
    rate: float, capacity: float, ops: list[tuple[str, float, float]]
) -> None:
    clock = Clock()
    start = clock.now
    bucket = TokenBucket(rate, capacity, clock=clock)
    usable_at: list[tuple[float, float]] = []  # (time the tokens may be used, amount)
    charged = 0.0
    last_use = start
    for kind, fraction, advance in ops:
        clock.now += advance
        amount = fraction * capacity
        if kind == "try":
            if bucket.try_acquire(amount):
                usable_at.append((clock.now, amount))
        elif kind in ("reserve", "reserve_timeout"):
            timeout = 0.5 if kind == "reserve_timeout" else None
            before = bucket.available
            try:
                wait = bucket.reserve(amount, timeout)
            except RateLimitTimeout:
                assert bucket.available == before  # refused: nothing taken
                continue
            assert wait >= 0
            if timeout is not None:
                assert wait <= timeout
            # FIFO: a later reservation is never usable before an earlier one.
            assert clock.now + wait >= last_use - 1e-9
            last_use = clock.now + wait
            usable_at.append((clock.now + wait, amount))
        elif kind == "refund_last" and usable_at:
            # A grant not yet used may be handed back once.
            _when, amount_back = usable_at.pop()
            bucket.refund(amount_back)
            # The cancelled reservation no longer holds anyone back.
            last_use = max((t for t, _ in usable_at), default=start)
        elif kind == "charge":
            bucket.charge(amount)
            charged += amount
        assert bucket.available <= capacity + 1e-9
        # Every window [start, t]: tokens usable by t never exceed what the bucket could make.
        for horizon in sorted({t for t, _ in usable_at} | {clock.now}):
            used = sum(a for t, a in usable_at if t <= horizon + 1e-9)
            assert used <= capacity + rate * (horizon - start) + 1e-6 * (1 + used)
