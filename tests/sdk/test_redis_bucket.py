"""Redis-backed buckets against a real redis-server on loopback (LLM_BACKOFF_TEST_REDIS_URL)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from llm_backoff.errors import RateLimitTimeout
from llm_backoff.limits import CallLimiter
from llm_backoff.ratelimit import RequestTooLargeError

REDIS_URL = os.environ.get("LLM_BACKOFF_TEST_REDIS_URL")
pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(
        not REDIS_URL, reason="LLM_BACKOFF_TEST_REDIS_URL not set (scripts/test.sh starts redis)"
    ),
]
redis = pytest.importorskip("redis")
from llm_backoff.redis_bucket import RedisRateLimiter, RedisTokenBucket, bucket_key  # noqa: E402


@pytest.fixture
def url() -> str:
    assert REDIS_URL is not None
    return REDIS_URL


@pytest.fixture
def key(url: str) -> Iterator[str]:
    name = f"llm-backoff-test:{uuid.uuid4().hex}"
    yield name
    client = redis.Redis.from_url(url)
    client.delete(*client.keys(f"{{{name}}}:*") or ["-"])
    client.close()


def server_time(url: str) -> float:
    client = redis.Redis.from_url(url)
    seconds, micros = client.time()
    client.close()
    return float(seconds) + micros / 1e6


def test_starts_full_then_refuses_and_times_out_fast(url: str, key: str) -> None:
    bucket = RedisTokenBucket(url, key, rate=0.5, capacity=3)
    try:
        assert [bucket.try_acquire() for _ in range(4)] == [True, True, True, False]
        with pytest.raises(RateLimitTimeout, match="shared rate limit"):
            bucket.acquire(timeout=0.05)  # the next token is ~2 s away
        with pytest.raises(RequestTooLargeError):
            bucket.acquire(4)
        assert bucket.available < 1
    finally:
        bucket.close()


def test_reservations_queue_in_order(url: str, key: str) -> None:
    bucket = RedisTokenBucket(url, key, rate=0.1, capacity=10)
    try:
        assert bucket.reserve(10) == 0.0
        big = bucket.reserve(5)
        small = bucket.reserve(1)
        # Slow refill, so seconds of scheduling delay on a busy machine barely matter.
        assert 45.0 < big <= 50.0 + 1e-6
        assert small == pytest.approx(big + 10.0, abs=0.5)
        assert bucket.try_acquire() is False
    finally:
        bucket.close()


def test_state_is_stamped_with_redis_server_time_and_expires(url: str, key: str) -> None:
    bucket = RedisTokenBucket(url, key, rate=1.0, capacity=10)
    client = redis.Redis.from_url(url)
    try:
        before = server_time(url)
        assert bucket.try_acquire(5)
        after = server_time(url)
        stamp = float(client.hget(bucket_key(key, "bucket"), "t"))
        assert before <= stamp <= after
        # Full again after 5 s: the key expires a second later instead of lingering.
        assert 0 < client.pttl(bucket_key(key, "bucket")) <= 6000
    finally:
        client.close()
        bucket.close()


def test_refund_and_charge_are_shared(url: str, key: str) -> None:
    a = RedisTokenBucket(url, key, rate=0.001, capacity=10)
    b = RedisTokenBucket(url, key, rate=0.001, capacity=10)
    try:
        assert a.try_acquire(10)
        assert not b.try_acquire(1)
        a.refund(4)
        assert b.try_acquire(4)
        b.charge(3)
        assert a.available == pytest.approx(-3, abs=0.01)
    finally:
        a.close()
        b.close()


async def test_async_acquire_and_cancellation(url: str, key: str) -> None:
    bucket = RedisTokenBucket(url, key, rate=4.0, capacity=2)
    try:
        # Tasks reach Redis over several connections, in no fixed order: two are
        # granted at once (the burst), the other two wait one and two refill steps.
        waits = sorted(await asyncio.gather(*(bucket.acquire_async() for _ in range(4))))
        assert waits[:2] == [0.0, 0.0]
        assert 0.0 < waits[2] <= 0.25 + 1e-6
        assert waits[2] < waits[3] <= 0.5 + 1e-6
        task = asyncio.create_task(bucket.acquire_async(2, timeout=5))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await bucket.aclose()  # flushes the give-back queued inside the loop
        assert bucket.available > -1.0
    finally:
        bucket.close()


def test_redis_rate_limiter_corrects_tokens_from_usage(url: str, key: str) -> None:
    tpm = 6000.0
    limiter = RedisRateLimiter(url, key, requests_per_second=100, tokens_per_minute=tpm)
    other = RedisRateLimiter(url, key, requests_per_second=100, tokens_per_minute=tpm)
    start = time.monotonic()

    def tokens_left(expected: float) -> None:
        # Redis refills in its own time: at least `expected`, plus no more than the
        # refill since the start (so the check does not depend on machine speed).
        left = other.available()["tokens_per_minute"]
        assert expected - 1e-6 <= left <= expected + tpm / 60 * (time.monotonic() - start) + 1e-6

    try:
        assert isinstance(limiter, CallLimiter)
        permit = limiter.acquire(1000)
        tokens_left(5000)
        permit.settle(status=200, body=json.dumps({"usage": {"total_tokens": 200}}).encode())
        tokens_left(5800)
        with pytest.raises(RateLimitTimeout):
            other.acquire(6000, timeout=1.0)
    finally:
        limiter.close()
        other.close()


async def test_redis_rate_limiter_async_settle_is_flushed_with_the_next_acquire(url: str, key: str) -> None:
    limiter = RedisRateLimiter(url, key, tokens_per_minute=60)
    observer = RedisRateLimiter(url, key, tokens_per_minute=60)
    start = time.monotonic()
    try:
        permit = await limiter.acquire_async(50)
        permit.settle(status=429, body=None)  # in a loop: queued, not a blocking round trip
        # Redis has not seen the give-back yet (only refill at 1 token/s since the start).
        assert observer.available()["tokens_per_minute"] <= 10 + (time.monotonic() - start) + 1e-6
        await limiter.acquire_async(0)  # carries it
        assert observer.available()["tokens_per_minute"] == pytest.approx(60)
    finally:
        await limiter.aclose()
        limiter.close()
        observer.close()


# Each child loads only the limiter modules: the package's __init__ pulls in the
# openai wrapper, whose import takes seconds on a busy 2-core machine.
CHILD = r"""
import importlib.util, sys, time, types
spec = importlib.util.find_spec("llm_backoff")
package = types.ModuleType("llm_backoff")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["llm_backoff"] = package
from llm_backoff.redis_bucket import RedisTokenBucket
url, key, rate, capacity, seconds, mode = sys.argv[1:7]
bucket = RedisTokenBucket(url, key, float(rate), float(capacity))
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + float(seconds)
granted = 0
while time.monotonic() < end:
    if mode == "try":
        if bucket.try_acquire():
            granted += 1
        else:
            time.sleep(0.001)  # a polite poller, not a CPU hog on a shared machine
    else:
        try:
            bucket.acquire(timeout=max(0.0, end - time.monotonic()))
            granted += 1
        except TimeoutError:
            break
print(granted, flush=True)
"""


def test_processes_share_one_budget_without_exceeding_it(url: str, key: str) -> None:
    rate, capacity, seconds = 40.0, 5.0, 1.0
    modes = ["try", "block", "block"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, url, key, str(rate), str(capacity), str(seconds), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for mode in modes
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready"
        start = server_time(url)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        counts = [int(p.communicate(timeout=30)[0].strip()) for p in procs]
        elapsed = server_time(url) - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    total = sum(counts)
    assert all(p.returncode == 0 for p in procs)
    # Never more than the budget, in Redis' own time.
    assert total <= rate * elapsed + capacity + 1e-6
    # And it is really shared: refills were handed out, and every blocking process got
    # some (a try_acquire loop may get none while others queue: waiters go first).
    assert total > capacity
    assert all(c > 0 for c, mode in zip(counts, modes, strict=True) if mode == "block")


async def test_a_cancellation_while_the_script_runs_gives_back_what_it_reserved(url: str, key: str) -> None:
    """Cancelled after Redis ran the reservation but before its reply was read: the reply
    decides, so the tokens it took come back."""
    bucket = RedisTokenBucket(url, key, rate=0.001, capacity=2)
    ran, reply_read = asyncio.Event(), asyncio.Event()
    store = bucket._store
    real_script = store._async_script()

    async def slow_reply(**kwargs: Any) -> Any:
        reply = await real_script(**kwargs)  # the reservation is made on Redis
        ran.set()
        await reply_read.wait()  # the reply is on its way when the caller is cancelled
        return reply

    try:
        store._async_script = lambda: slow_reply  # type: ignore[method-assign]
        task = asyncio.create_task(bucket.acquire_async(2, timeout=5))
        await ran.wait()
        task.cancel()
        await asyncio.sleep(0)
        reply_read.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        del store._async_script
        await bucket.aclose()
        assert bucket.available == pytest.approx(2.0, abs=0.01)
        assert bucket.try_acquire(2)
    finally:
        bucket.close()
