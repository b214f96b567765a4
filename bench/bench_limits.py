"""Client-side limits: llm_backoff's buckets side by side with pyrate-limiter.

    .venv/bin/python bench/bench_limits.py [--quick] [--redis-url redis://127.0.0.1:6399/0]

Measures, in one run, ours and pyrate-limiter's token bucket (GCRA) where both
exist:

1. uncontended in-process ``try_acquire`` cost (target <= 2 us);
2. contended throughput, 8 threads on one bucket;
3. blocking accuracy: 8 threads blocking on a 1000/s bucket, achieved rate;
4. FIFO fairness: how long a 10-token request waits while 4 threads stream
   1-token requests (ideal: about 0.1 s at 100 tokens/s);
5. asyncio: 200 tasks on a 500/s bucket, achieved rate;
6. Redis: one acquire's round trip (median, p99);
7. Redis: N processes sharing one bucket, aggregate rate vs configured (target
   within 5 %), rate taken in Redis server time;
8. Redis: the same with one host's clock 2 s ahead (pyrate-limiter stamps time on
   the client; ours reads Redis' TIME inside the script).

Sections 6-8 need a redis-server (started here on a free port if none is given
and ``redis-server`` is installed). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from llm_backoff.ratelimit import RateLimiter, TokenBucket

try:
    import pyrate_limiter as pl
except ImportError:  # pragma: no cover - the comparison column is then empty
    pl = None

ROWS: list[tuple[str, str, str, str]] = []


def progress(msg: str) -> None:
    print(f"[bench_limits] {msg}", file=sys.stderr, flush=True)


def row(what: str, ours: str, theirs: str, note: str = "") -> None:
    ROWS.append((what, ours, theirs, note))
    progress(f"{what}: ours {ours} | pyrate-limiter {theirs} {note}")


def pyrate_limiter(rate: int, burst: int | None = None, store: Any = None, clock: Any = None) -> Any:
    assert pl is not None
    bucket = pl.StateBucket([pl.Rate(rate, pl.Duration.SECOND, burst=burst)], pl.TokenBucket(), store, clock)
    return pl.Limiter(bucket, buffer_ms=0 if store is None else 50)


# --------------------------------------------------------------------------- in-process


def per_call_us(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def bench_uncontended(n: int, rounds: int) -> None:
    ours = TokenBucket(rate=1e12, capacity=1e12)
    limiter = RateLimiter(requests_per_second=1e9)
    theirs = pyrate_limiter(10**9) if pl else None
    a, b, c = [], [], []
    for _ in range(rounds):  # interleaved, so drift in machine load hits all alike
        a.append(per_call_us(ours.try_acquire, n))
        c.append(per_call_us(limiter.try_acquire, n))
        if theirs is not None:
            b.append(per_call_us(lambda: theirs.try_acquire("k", blocking=False), n))
    ma, mb = statistics.median(a), statistics.median(b) if b else float("nan")
    row("try_acquire, uncontended (us/call)", f"{ma:.2f}", f"{mb:.2f}", f"ratio {mb / ma:.1f}x")
    row("RateLimiter.try_acquire (permit), us/call", f"{statistics.median(c):.2f}", "-", "")
    lock = threading.Lock()

    def floor() -> None:
        with lock:
            time.monotonic()

    # What any thread-safe bucket must pay at least: shows how loaded the machine is.
    row("floor: a lock + time.monotonic(), us/call", f"{per_call_us(floor, n):.2f}", "-", "")


def threaded_ops(fn: Callable[[], object], threads: int, per_thread: int) -> float:
    barrier = threading.Barrier(threads + 1)

    def work() -> None:
        barrier.wait()
        for _ in range(per_thread):
            fn()

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in ts:
        t.join()
    return threads * per_thread / (time.perf_counter() - start)


def bench_contended(per_thread: int) -> None:
    ours = TokenBucket(rate=1e12, capacity=1e12)
    theirs = pyrate_limiter(10**9) if pl else None
    a = threaded_ops(ours.try_acquire, 8, per_thread)
    b = (
        threaded_ops(lambda: theirs.try_acquire("k", blocking=False), 8, per_thread)
        if theirs
        else float("nan")
    )
    row("try_acquire, 8 threads (calls/s)", f"{a:,.0f}", f"{b:,.0f}", f"ratio {a / b:.2f}x")


def blocking_rate(acquire: Callable[[], object], seconds: float, threads: int = 8) -> float:
    stop = time.monotonic() + seconds
    counts = [0] * threads

    def work(i: int) -> None:
        while time.monotonic() < stop:
            acquire()
            counts[i] += 1

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts) / (time.monotonic() - start)


def bench_blocking(rate: int, seconds: float) -> None:
    ours = TokenBucket(rate=rate, capacity=1)
    theirs = pyrate_limiter(rate, burst=1) if pl else None
    a = blocking_rate(ours.acquire, seconds)
    b = blocking_rate(lambda: theirs.try_acquire("k"), seconds) if theirs else float("nan")
    row(
        f"blocking acquire, 8 threads, {rate}/s (achieved/s)",
        f"{a:,.0f} ({a / rate - 1:+.1%})",
        f"{b:,.0f} ({b / rate - 1:+.1%})",
    )


def big_request_wait(
    acquire_small: Callable[[], object], acquire_big: Callable[[], bool], limit: float
) -> float:
    """Seconds a 10-token request waits while 4 threads stream 1-token requests."""
    stop = threading.Event()

    def small() -> None:
        while not stop.is_set():
            acquire_small()

    ts = [threading.Thread(target=small, daemon=True) for _ in range(4)]
    for t in ts:
        t.start()
    time.sleep(0.3)
    start = time.monotonic()
    granted = acquire_big()
    waited = time.monotonic() - start
    stop.set()
    for t in ts:
        t.join(limit + 1)
    return waited if granted else float("inf")


def bench_fifo(limit: float) -> None:
    ours = TokenBucket(rate=100, capacity=10)

    def ours_big() -> bool:
        ours.acquire(10)
        return True

    a = big_request_wait(ours.acquire, ours_big, limit)
    if pl:
        theirs = pyrate_limiter(100, burst=10)

        def theirs_big() -> bool:
            with contextlib.suppress(TimeoutError):
                return bool(theirs.try_acquire("k", weight=10, timeout=limit))
            return False

        b = big_request_wait(lambda: theirs.try_acquire("k"), theirs_big, limit)
    else:
        b = float("nan")
    fmt = lambda s: f"{s:.2f} s" if s != float("inf") else f"starved (> {limit:.0f} s)"  # noqa: E731
    row("10-token request among 1-token streams, wait", fmt(a), fmt(b), "(ideal ~0.1-0.2 s)")


def bench_async(rate: int, seconds: float) -> None:
    async def run(acquire: Callable[[], Any]) -> float:
        stop = time.monotonic() + seconds
        count = 0

        async def task() -> None:
            nonlocal count
            while time.monotonic() < stop:
                await acquire()
                count += 1

        start = time.monotonic()
        await asyncio.gather(*(task() for _ in range(200)))
        return count / (time.monotonic() - start)

    ours = TokenBucket(rate=rate, capacity=1)
    a = asyncio.run(run(ours.acquire_async))
    if pl:
        theirs = pyrate_limiter(rate, burst=1)
        b = asyncio.run(run(lambda: theirs.try_acquire_async("k")))
    else:
        b = float("nan")
    row(
        f"acquire_async, 200 tasks, {rate}/s (achieved/s)",
        f"{a:,.0f} ({a / rate - 1:+.1%})",
        f"{b:,.0f} ({b / rate - 1:+.1%})",
    )


# --------------------------------------------------------------------------- Redis


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str | None]:
    if url:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        progress("no redis-server: skipping the Redis sections")
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_redis_round_trip(url: str, n: int) -> None:
    import redis

    from llm_backoff.redis_bucket import RedisTokenBucket

    ours = RedisTokenBucket(url, f"bench:{uuid.uuid4().hex}", rate=1e9, capacity=1e9)
    client = redis.Redis.from_url(url)
    theirs = (
        pyrate_limiter(10**9, store=pl.RedisStateStore(client, f"bench:{uuid.uuid4().hex}")) if pl else None
    )
    a: list[float] = []
    b: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        ours.try_acquire()
        a.append(time.perf_counter() - t)
        if theirs is not None:
            t = time.perf_counter()
            theirs.try_acquire("k", blocking=False)
            b.append(time.perf_counter() - t)
    ma, mb = statistics.median(a) * 1e6, (statistics.median(b) * 1e6 if b else float("nan"))
    row(
        "Redis try_acquire round trip, median (p99), us",
        f"{ma:.0f} ({_percentile(a, 0.99) * 1e6:.0f})",
        f"{mb:.0f} ({_percentile(b, 0.99) * 1e6:.0f})" if b else "-",
        f"ratio {mb / ma:.2f}x",
    )
    ours.close()
    client.close()


def _server_time(url: str) -> float:
    import redis

    client = redis.Redis.from_url(url)
    s, us = client.time()
    client.close()
    return float(s) + us / 1e6


def _worker(
    kind: str, url: str, key: str, rate: float, seconds: float, skew: float, go: Any, out: Any
) -> None:
    """One process hammering the shared bucket with blocking acquires."""
    if kind == "ours":
        from llm_backoff.redis_bucket import RedisTokenBucket

        bucket = RedisTokenBucket(url, key, rate=rate, capacity=1)
        acquire: Callable[[float], bool] = lambda left: bucket.acquire(timeout=left) >= 0  # noqa: E731
    else:
        import redis

        class SkewedClock(pl.AbstractClock):  # type: ignore[misc]
            def now(self) -> int:
                return int((time.time() + skew) * 1000)

        store = pl.RedisStateStore(redis.Redis.from_url(url), key)
        limiter = pyrate_limiter(int(rate), burst=1, store=store, clock=SkewedClock())
        acquire = lambda left: bool(limiter.try_acquire("k", timeout=left))  # noqa: E731
    if kind == "ours":
        _ = bucket.available  # connect and load the script before the start
    out.put("ready")
    go.wait()
    end = time.monotonic() + seconds
    granted = 0
    while (left := end - time.monotonic()) > 0:
        try:
            granted += acquire(left)
        except TimeoutError:
            break
    out.put(granted)


def shared_rate(kind: str, url: str, procs: int, rate: float, seconds: float, skews: list[float]) -> float:
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    key = f"bench:{uuid.uuid4().hex}"
    ps = [
        ctx.Process(target=_worker, args=(kind, url, key, rate, seconds, skews[i], go, out))
        for i in range(procs)
    ]
    for p in ps:
        p.start()
    for _ in ps:  # every process imported and connected before the clock starts
        assert out.get(timeout=120) == "ready"
    start = _server_time(url)
    go.set()
    total = sum(out.get(timeout=seconds + 60) for _ in ps)
    elapsed = _server_time(url) - start
    for p in ps:
        p.join(10)
    # capacity 1: at most one token of burst on top of rate * elapsed
    return (total - 1) / elapsed


def bench_redis_shared(url: str, procs: int, rate: float, seconds: float) -> None:
    a = shared_rate("ours", url, procs, rate, seconds, [0.0] * procs)
    b = shared_rate("pyrate", url, procs, rate, seconds, [0.0] * procs) if pl else float("nan")
    row(
        f"{procs} processes sharing a Redis bucket at {rate:.0f}/s (aggregate/s)",
        f"{a:.1f} ({a / rate - 1:+.1%})",
        f"{b:.1f} ({b / rate - 1:+.1%})",
    )
    skews = [2.0] + [0.0] * (procs - 1)
    c = shared_rate("ours", url, procs, rate, seconds, skews)  # ours ignores client clocks
    d = shared_rate("pyrate", url, procs, rate, seconds, skews) if pl else float("nan")
    row(
        "  same, one host's clock 2 s ahead (aggregate/s)",
        f"{c:.1f} ({c / rate - 1:+.1%})",
        f"{d:.1f} ({d / rate - 1:+.1%})",
    )


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller counts, shorter runs")
    parser.add_argument("--redis-url", default=os.environ.get("LLM_BACKOFF_TEST_REDIS_URL"))
    parser.add_argument("--procs", type=int, default=4)
    args = parser.parse_args()
    q = args.quick
    progress(f"python {sys.version.split()[0]}, pyrate-limiter {pl.__version__ if pl else 'absent'}")
    progress("1/8 uncontended try_acquire")
    bench_uncontended(n=20_000 if q else 100_000, rounds=3 if q else 7)
    progress("2/8 contended try_acquire")
    bench_contended(per_thread=5_000 if q else 25_000)
    progress("3/8 blocking accuracy")
    bench_blocking(rate=1000, seconds=1.0 if q else 3.0)
    progress("4/8 FIFO fairness")
    bench_fifo(limit=3.0 if q else 5.0)
    progress("5/8 asyncio")
    bench_async(rate=500, seconds=1.0 if q else 3.0)
    with redis_server(args.redis_url) as url:
        if url:
            progress("6/8 Redis round trip")
            bench_redis_round_trip(url, n=500 if q else 3000)
            progress("7-8/8 Redis shared by processes (each run: process start-up + the measured window)")
            bench_redis_shared(url, args.procs, rate=200.0, seconds=2.0 if q else 5.0)
    width = max(len(r[0]) for r in ROWS)
    print(
        f"\n| {'measure'.ljust(width)} | llm_backoff | pyrate-limiter {pl.__version__ if pl else ''} | note |"
    )
    print(f"| {'-' * width} | --- | --- | --- |")
    for what, ours, theirs, note in ROWS:
        print(f"| {what.ljust(width)} | {ours} | {theirs} | {note} |")


if __name__ == "__main__":
    main()
