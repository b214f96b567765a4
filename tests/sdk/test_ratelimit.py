"""TokenBucket and RateLimiter: bucket math and FIFO on a fake clock, real threads and tasks."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backoff.errors import RateLimitTimeout
from llm_backoff.limits import CallLimiter, Permit
from llm_backoff.ratelimit import RateLimiter, RequestTooLargeError, TokenBucket


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeRequest:
    method: str
    content: bytes


def chat_request(max_tokens: int, prompt: str = "") -> FakeRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    return FakeRequest("POST", json.dumps(body).encode())


def drain(bucket: TokenBucket) -> int:
    n = 0
    while bucket.try_acquire():
        n += 1
    return n


# --------------------------------------------------------------------------- TokenBucket


def test_starts_full_refills_at_rate_and_caps_at_capacity() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=4.0, capacity=10.0, clock=clock)
    assert drain(bucket) == 10
    clock.now += 0.5
    assert drain(bucket) == 2
    clock.now += 3600.0
    assert bucket.available == 10.0
    assert drain(bucket) == 10


def test_reserve_returns_the_wait_and_queues_in_order() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=1.0, capacity=10.0, clock=clock)
    assert bucket.reserve(10) == 0.0
    assert bucket.reserve(5) == pytest.approx(5.0)  # large request first
    assert bucket.reserve(1) == pytest.approx(6.0)  # then a small one queues behind it
    assert bucket.available == pytest.approx(-6.0)


def test_a_large_request_is_not_starved_by_a_stream_of_small_ones() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=10.0, capacity=10.0, clock=clock)
    drain(bucket)
    big_wait = bucket.reserve(8)
    big_at = clock.now + big_wait
    small_granted_before_big = 0
    while clock.now < big_at - 1e-9:
        clock.now += 0.01
        small_granted_before_big += bucket.try_acquire(1)
    assert small_granted_before_big == 0
    # When the big request's time comes, its tokens were there all along (debt repaid).
    assert bucket.available >= -1e-9
    assert big_wait == pytest.approx(0.8)


def test_timeout_fails_fast_and_takes_nothing() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, capacity=4.0, clock=clock)
    drain(bucket)
    with pytest.raises(RateLimitTimeout, match=r"beyond the 1\.000 s"):
        bucket.acquire(4, timeout=1.0)  # needs 2 s
    assert bucket.available == 0.0
    assert bucket.reserve(2, timeout=1.0) == pytest.approx(1.0)
    with pytest.raises(RateLimitTimeout):
        bucket.acquire(1, timeout=-5.0)  # a deadline already passed counts as 0
    assert isinstance(RateLimitTimeout("x"), TimeoutError)


def test_request_larger_than_capacity_is_a_clear_error_not_a_hang() -> None:
    bucket = TokenBucket(rate=1.0, capacity=5.0)
    with pytest.raises(RequestTooLargeError, match="capacity 5"):
        bucket.acquire(6)
    with pytest.raises(ValueError, match="never be granted"):
        bucket.try_acquire(6)
    assert bucket.available == 5.0


@pytest.mark.parametrize("amount", [-1, math.nan, math.inf])
def test_bad_amounts(amount: float) -> None:
    with pytest.raises(ValueError, match="amount"):
        TokenBucket(1.0, 5.0).try_acquire(amount)


@pytest.mark.parametrize(("rate", "capacity"), [(0, 1), (-1, 1), (1, 0), (math.nan, 1), (1, math.inf)])
def test_bad_settings(rate: float, capacity: float) -> None:
    with pytest.raises(ValueError, match=r"rate|capacity"):
        TokenBucket(rate, capacity)


def test_bad_types() -> None:
    with pytest.raises(TypeError):
        TokenBucket("1", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TokenBucket(1, 1).try_acquire(True)


def test_refund_and_charge() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=1.0, capacity=5.0, clock=clock)
    bucket.refund(100)
    assert bucket.available == 5.0  # never beyond capacity
    bucket.charge(8)
    assert bucket.available == -3.0  # debt that later callers wait for
    assert bucket.reserve(1) == pytest.approx(4.0)


def test_set_rate_applies_to_debt_not_yet_repaid() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=10.0, capacity=10.0, clock=clock)
    drain(bucket)
    bucket.set_rate(1.0, capacity=2.0)
    assert bucket.reserve(1) == pytest.approx(1.0)
    assert bucket.capacity == 2.0


def test_threads_never_exceed_rate_plus_burst() -> None:
    rate, capacity = 200.0, 5.0
    bucket = TokenBucket(rate=rate, capacity=capacity)
    grants: list[float] = []
    lock = threading.Lock()
    start = time.monotonic()

    def worker() -> None:
        for _ in range(15):
            bucket.acquire()
            with lock:
                grants.append(time.monotonic())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(grants) == 120
    # Whatever the scheduling, by any moment at most burst + rate * elapsed were granted
    # (a grant wakes at or after its slot; late wake-ups can only lower the count).
    grants.sort()
    for n, at in enumerate(grants, start=1):
        assert n <= capacity + rate * (at - start) + 1e-6


async def test_async_waiters_are_served_in_arrival_order() -> None:
    bucket = TokenBucket(rate=50.0, capacity=5.0)
    bucket.acquire(5)
    order: list[str] = []

    async def take(name: str, amount: float) -> None:
        await bucket.acquire_async(amount)
        order.append(name)

    # The big request arrives first; the small ones must not overtake it.
    tasks = [asyncio.create_task(take("big", 5))]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(take(f"small{i}", 1)) for i in range(5)]
    await asyncio.gather(*tasks)
    assert order == ["big", "small0", "small1", "small2", "small3", "small4"]


async def test_cancelled_async_waiter_gives_its_tokens_back() -> None:
    clock_bucket = TokenBucket(rate=0.1, capacity=3.0)
    clock_bucket.acquire(3)
    task = asyncio.create_task(clock_bucket.acquire_async(3))
    await asyncio.sleep(0.01)
    assert clock_bucket.available < -2.5
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert clock_bucket.available >= 0.0


def test_many_event_loops_and_threads_share_one_bucket() -> None:
    bucket = TokenBucket(rate=500.0, capacity=10.0)
    done: list[int] = []

    def run_loop() -> None:
        async def main() -> int:
            await asyncio.gather(*(bucket.acquire_async() for _ in range(20)))
            return 20

        done.append(asyncio.run(main()))

    threads = [threading.Thread(target=run_loop) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(20):
        bucket.acquire()
    for t in threads:
        t.join()
    assert sum(done) == 60
    assert bucket.available <= 10.0


# --------------------------------------------------------------------------- RateLimiter


def test_limiter_implements_the_transport_protocols() -> None:
    limiter = RateLimiter(requests_per_second=5)
    assert isinstance(limiter, CallLimiter)
    permit = limiter.acquire_for(chat_request(10), timeout=None)
    assert isinstance(permit, Permit)


def test_request_limits_combine() -> None:
    clock = FakeClock()
    limiter = RateLimiter(requests_per_second=10, requests_per_minute=12, clock=clock)
    granted = 0
    for _ in range(1000):  # 10 s at one attempt per 10 ms
        clock.now += 0.01
        granted += limiter.try_acquire() is not None
    # The per-minute bucket binds: a burst of 12 (10 at once, the per-second bucket
    # holds 10), then one every 5 s: at 5.1 s; the next would be at 10.1 s.
    assert granted == 12 + 1
    assert limiter.available()["requests_per_minute"] < 1


def test_burst_caps_back_to_back_requests() -> None:
    clock = FakeClock()
    limiter = RateLimiter(requests_per_minute=600, burst=3, clock=clock)
    assert sum(limiter.try_acquire() is not None for _ in range(10)) == 3


def test_tokens_charged_from_estimate_then_corrected_from_usage() -> None:
    clock = FakeClock()
    limiter = RateLimiter(tokens_per_minute=6000, clock=clock)
    request = chat_request(max_tokens=1000, prompt="x" * 400)
    estimate = limiter.estimate(request)
    assert estimate > 1000
    permit = limiter.acquire_for(request, timeout=None)
    assert limiter.available()["tokens_per_minute"] == pytest.approx(6000 - estimate)
    usage = {"usage": {"prompt_tokens": 100, "completion_tokens": 150, "total_tokens": 250}}
    permit.settle(status=200, body=json.dumps(usage).encode())
    assert limiter.available()["tokens_per_minute"] == pytest.approx(6000 - 250)
    permit.settle(status=200, body=b"")  # a second settle must not refund twice
    assert limiter.available()["tokens_per_minute"] == pytest.approx(6000 - 250)


def test_usage_above_the_estimate_is_charged_as_debt() -> None:
    clock = FakeClock()
    limiter = RateLimiter(tokens_per_minute=600, clock=clock)
    permit = limiter.acquire(100)
    permit.settle(status=200, body=b'{"usage": {"total_tokens": 700}}')
    assert limiter.available()["tokens_per_minute"] == pytest.approx(-100)
    with pytest.raises(RateLimitTimeout):
        limiter.acquire(10, timeout=5.0)  # 110 tokens at 10/s: 11 s away


def test_streamed_usage_in_the_sse_tail_corrects_the_charge() -> None:
    clock = FakeClock()
    limiter = RateLimiter(tokens_per_minute=6000, clock=clock)
    permit = limiter.acquire(2000)
    tail = (
        b'ta: {"choices":[{"delta":{}}],"usage":null}\n\n'
        b'data: {"choices":[],"usage":{"total_tokens":321}}\n\n'
    )
    permit.settle(status=200, body=tail + b"data: [DONE]\n\n")
    assert limiter.available()["tokens_per_minute"] == pytest.approx(6000 - 321)


@pytest.mark.parametrize(
    ("status", "body", "left"),
    [
        (429, b'{"error": {"message": "slow down"}}', 6000),  # nothing generated: estimate back
        (500, None, 6000),
        (200, b'{"choices": []}', 6000 - 1000),  # success without usage: keep the estimate
        (None, None, 6000 - 1000),  # failed without a response: it may have reached the model
    ],
)
def test_settle_without_usage(status: int | None, body: bytes | None, left: float) -> None:
    limiter = RateLimiter(tokens_per_minute=6000, clock=FakeClock())
    limiter.acquire(1000).settle(status=status, body=body)
    assert limiter.available()["tokens_per_minute"] == pytest.approx(left)


def test_estimate_above_capacity_is_capped_not_refused() -> None:
    limiter = RateLimiter(tokens_per_minute=500, clock=FakeClock())
    permit = limiter.acquire_for(chat_request(max_tokens=10_000), timeout=None)
    assert permit.estimated_tokens == 500
    assert limiter.available()["tokens_per_minute"] == 0


def test_all_or_nothing_when_one_bucket_would_time_out() -> None:
    clock = FakeClock()
    limiter = RateLimiter(requests_per_second=100, tokens_per_minute=600, clock=clock)
    limiter.acquire(600)
    before = limiter.available()
    with pytest.raises(RateLimitTimeout):
        limiter.acquire(10, timeout=0.5)
    assert limiter.available() == before  # the request bucket did not lose its token


def test_httpx_request_is_priced_from_its_url_and_body() -> None:
    httpx = pytest.importorskip("httpx")
    limiter = RateLimiter(tokens_per_minute=100_000, default_max_tokens=50)
    body: dict[str, Any] = {"model": "e", "input": "a" * 400}
    emb = httpx.Request("POST", "http://x/v1/embeddings", json=body)
    chat = httpx.Request("POST", "http://x/v1/responses", json=body)
    assert limiter.estimate(emb) == 100
    assert limiter.estimate(chat) == 150
    assert limiter.estimate(httpx.Request("GET", "http://x/v1/models")) == 0


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"requests_per_second": 0}, {"tokens_per_minute": -5}, {"burst": 0, "requests_per_second": 1}],
)
def test_limiter_settings_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"requests_per_second|tokens_per_minute|burst|at least one"):
        RateLimiter(**kwargs)


async def test_async_acquire_for_and_cancellation_gives_back() -> None:
    limiter = RateLimiter(requests_per_second=20, burst=1)
    await limiter.acquire_for_async(chat_request(1), timeout=None)
    task = asyncio.create_task(limiter.acquire_async(timeout=10))
    await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The cancelled waiter's reservation is returned: the next caller does not pay for it.
    assert limiter.available()["requests_per_second"] > -0.5


def test_adaptive_starts_unthrottled_then_enforces_then_recovers() -> None:
    clock = FakeClock()
    limiter = RateLimiter(adaptive=True, min_rate=1.0, clock=clock)
    assert limiter.adaptive_rate is None
    # Unthrottled: everything goes out at 50/s for 3 s.
    for _ in range(150):
        clock.now += 0.02
        permit = limiter.try_acquire()
        assert permit is not None
        permit.settle(status=200, body=None)
    assert limiter.adaptive_rate is None
    limiter.acquire().settle(status=429, body=None)
    cut = limiter.adaptive_rate
    assert cut is not None
    assert 0.6 * 50 < cut < 0.75 * 50
    # Enforced now: of 100 attempts in the next second, fewer than the 50/s sent before
    # get out (the rate climbs back from `cut` along the cubic during that second).
    sent = 0
    for _ in range(100):
        clock.now += 0.01
        permit = limiter.try_acquire()
        if permit is not None:
            sent += 1
            permit.settle(status=200, body=None)
    assert 0 < sent < 50
    # Successes make it climb back.
    for _ in range(300):
        clock.now += 0.01
        permit = limiter.try_acquire()
        if permit is not None:
            permit.settle(status=200, body=None)
    rate = limiter.adaptive_rate
    assert rate is not None
    assert rate > cut


def test_adaptive_never_above_configured_ceiling() -> None:
    clock = FakeClock()
    limiter = RateLimiter(requests_per_second=5, adaptive=True, clock=clock)
    for _ in range(50):
        clock.now += 0.2
        permit = limiter.try_acquire()
        if permit is not None:
            permit.settle(status=503, body=None)
    for _ in range(3000):
        clock.now += 0.01
        permit = limiter.try_acquire()
        if permit is not None:
            permit.settle(status=200, body=None)
    rate = limiter.adaptive_rate
    assert rate is not None
    assert rate <= 5.0


# --------------------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.1, 1000),
    capacity=st.floats(1, 100),
    ops=st.lists(st.tuples(st.floats(0, 2), st.floats(0, 1), st.booleans()), max_size=60),
)
def test_reservations_are_fifo_and_never_exceed_rate_plus_burst(
    rate: float, capacity: float, ops: list[tuple[float, float, bool]]
) -> None:
    clock = FakeClock(0.0)
    bucket = TokenBucket(rate=rate, capacity=capacity, clock=clock)
    slots: list[tuple[float, float]] = []
    for dt, fraction, non_blocking in ops:
        clock.now += dt
        amount = fraction * capacity
        if non_blocking:
            if bucket.try_acquire(amount):
                slots.append((clock.now, amount))
        else:
            slots.append((clock.now + bucket.reserve(amount), amount))
    # FIFO: every grant's slot is no earlier than the one before it.
    assert all(a[0] <= b[0] + 1e-9 for a, b in itertools.pairwise(slots))
    # Never more than the burst plus the refill up to any grant's slot.
    granted = 0.0
    for slot, amount in slots:
        granted += amount
        assert granted <= capacity + rate * slot + 1e-6 * (1 + granted)
