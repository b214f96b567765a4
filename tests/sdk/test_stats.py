"""ClientStats: per-client counters fed by the transport engine.

Engine-level tests run the retry transports over MockTransports with fake time, so
every wait is known exactly; the wrap() tests go through real openai clients.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import openai
import pytest

from llm_backoff import RateLimitTimeout, RetryEvent, RetryObservers, RetryPolicy, wrap
from llm_backoff.budget import RetryBudget
from llm_backoff.events import CallObserver
from llm_backoff.ratelimit import RateLimiter
from llm_backoff.stats import WAIT_THRESHOLD, ClientStats, StatsSnapshot
from llm_backoff.testing import instant_retries
from llm_backoff.wrap import call_observers, client_stats

OPENAI3 = openai.__version__.startswith("3.")
Handler = Callable[[Any], Any]


def event(reason: str = "status 429", wait: float = 1.5) -> RetryEvent:
    return RetryEvent(attempt=1, reason=reason, wait=wait, hint=None, elapsed=0.0, method="POST", url="u")


def engine_client(
    lib: ModuleType, handler: Handler, fake_time: Any, *, is_async: bool = False, **kw: Any
) -> Any:
    from llm_backoff import transport

    cls: Any
    if lib.__name__ == "httpx2":
        cls = transport.AsyncHttpx2RetryTransport if is_async else transport.Httpx2RetryTransport
    else:
        cls = transport.AsyncHttpxRetryTransport if is_async else transport.HttpxRetryTransport
    policy = kw.pop("policy", RetryPolicy(max_attempts=4))
    retry = cls(lib.MockTransport(handler), policy, **{**fake_time.engine_options(), **kw})
    client_cls = lib.AsyncClient if is_async else lib.Client
    return client_cls(transport=retry, base_url="http://api"), retry.engine


def script(lib: ModuleType, *answers: Any) -> Handler:
    seen: list[Any] = []

    def handler(request: Any) -> Any:
        seen.append(request)
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, type) and issubclass(answer, Exception):
            failure: Any = answer
            raise failure("scripted", request=request)
        status, *hint = answer
        headers = {"retry-after": hint[0]} if hint else {}
        return lib.Response(status, headers=headers, json={"ok": status < 400})

    return handler


# -- the counters themselves ---------------------------------------------------------


def test_counters_follow_the_events() -> None:
    stats = ClientStats()
    stats.retrying(event("status 429", 1.5))
    stats.retrying(event("status 429", 0.5))
    stats.retrying(event("timeout (ReadTimeout)", 0.25))
    stats.budget_refused()
    stats.limiter_waited(0.0, granted=True)
    stats.limiter_waited(0.2, granted=True)
    stats.limiter_waited(WAIT_THRESHOLD / 10, granted=False)
    stats.call_ended("ok", 3)
    stats.call_ended("failed", 2)
    stats.call_ended("cancelled", 0)
    snap = stats.snapshot()
    assert snap.calls == 3
    assert (snap.failed_calls, snap.cancelled_calls, snap.attempts) == (1, 1, 5)
    assert snap.retries == 3
    assert dict(snap.retries_by_reason) == {"status 429": 2, "timeout (ReadTimeout)": 1}
    assert snap.retry_wait_seconds == pytest.approx(2.25)
    assert snap.budget_refusals == 1
    assert (snap.limiter_acquisitions, snap.limiter_waits, snap.limiter_timeouts) == (2, 1, 1)
    assert snap.limiter_wait_seconds == pytest.approx(0.2)
    assert stats.retries == 3
    assert dict(stats.retries_by_reason) == dict(snap.retries_by_reason)
    assert "retries=3" in repr(stats)


def test_snapshot_difference_is_the_activity_between() -> None:
    stats = ClientStats()
    stats.retrying(event("status 503", 1.0))
    stats.call_ended("ok", 2)
    before = stats.snapshot()
    stats.retrying(event("status 429", 2.0))
    stats.retrying(event("status 429", 2.0))
    stats.call_ended("failed", 3)
    delta = stats.snapshot() - before
    assert delta.calls == 1
    assert delta.failed_calls == 1
    assert delta.attempts == 3
    assert dict(delta.retries_by_reason) == {"status 429": 2}  # reasons that did not move are left out
    assert delta.retry_wait_seconds == pytest.approx(4.0)
    assert delta.as_dict()["retries_by_reason"] == {"status 429": 2}
    assert StatsSnapshot() - StatsSnapshot() == StatsSnapshot()


def test_snapshots_are_immutable() -> None:
    stats = ClientStats()
    stats.retrying(event())
    snap = stats.snapshot()
    with pytest.raises(TypeError):
        snap.retries_by_reason["status 429"] = 7  # type: ignore[index]
    stats.retrying(event())
    assert snap.retries_by_reason["status 429"] == 1


def test_counts_are_exact_under_threads() -> None:
    stats = ClientStats()
    per_thread, threads = 2000, 8
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        start.wait()
        for _ in range(per_thread):
            stats.retrying(event(f"status {500 + i % 2}", 0.5))
            stats.call_ended("ok", 2)
            stats.snapshot()  # readers interleave with writers

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    snap = stats.snapshot()
    assert snap.calls == snap.retries == per_thread * threads
    assert snap.attempts == 2 * per_thread * threads
    assert dict(snap.retries_by_reason) == {"status 500": per_thread * 4, "status 501": per_thread * 4}
    assert snap.retry_wait_seconds == pytest.approx(0.5 * per_thread * threads)


# -- fed by the engine ---------------------------------------------------------------


def test_retries_then_success(lib: ModuleType, fake_time: Any) -> None:
    client, engine = engine_client(lib, script(lib, (429, "2"), (503,), (200,)), fake_time)
    with client:
        assert client.get("/x").status_code == 200
    snap = engine.stats.snapshot()
    assert (snap.calls, snap.failed_calls, snap.attempts, snap.retries) == (1, 0, 3, 2)
    assert dict(snap.retries_by_reason) == {"status 429": 1, "status 503": 1}
    assert snap.retry_wait_seconds == pytest.approx(sum(fake_time.sleeps))
    assert fake_time.sleeps[0] >= 2.0  # the server's hint was honoured and counted
    assert snap.limiter_acquisitions == 0
    assert snap.budget_refusals == 0


async def test_async_giving_up_counts_a_failed_call(lib: ModuleType, fake_time: Any) -> None:
    handler = script(lib, (429, "1"))
    client, engine = engine_client(lib, handler, fake_time, is_async=True, policy=RetryPolicy(max_attempts=3))
    async with client:
        assert (await client.get("/x")).status_code == 429
        assert (await client.get("/y")).status_code == 429
    snap = engine.stats.snapshot()
    assert (snap.calls, snap.failed_calls, snap.attempts, snap.retries) == (2, 2, 6, 4)
    assert snap.retry_wait_seconds == pytest.approx(sum(fake_time.sleeps))


def test_transport_errors_and_non_retryable_statuses(lib: ModuleType, fake_time: Any) -> None:
    client, engine = engine_client(lib, script(lib, lib.ConnectError, (400,)), fake_time)
    with client:
        assert client.get("/x").status_code == 400
    snap = engine.stats.snapshot()
    assert (snap.calls, snap.failed_calls, snap.attempts) == (1, 1, 2)
    assert dict(snap.retries_by_reason) == {"connection error (ConnectError)": 1}

    client, engine = engine_client(
        lib, script(lib, lib.ReadTimeout), fake_time, policy=RetryPolicy(max_attempts=2)
    )
    with client, pytest.raises(lib.ReadTimeout):
        client.get("/x")
    snap = engine.stats.snapshot()
    assert (snap.calls, snap.failed_calls, snap.attempts, snap.retries) == (1, 1, 2, 1)


def test_budget_refusals(lib: ModuleType, fake_time: Any) -> None:
    budget = RetryBudget(
        ratio=0.0, min_per_second=0.1, ttl=10.0, clock=fake_time.clock
    )  # one retry in reserve
    client, engine = engine_client(lib, script(lib, (503,)), fake_time, budget=budget)
    with client:
        assert client.get("/a").status_code == 503
        assert client.get("/b").status_code == 503
    snap = engine.stats.snapshot()
    # /a: 503, retry (the reserve), 503, refused; /b: 503, refused.
    assert (snap.calls, snap.failed_calls, snap.attempts, snap.retries) == (2, 2, 3, 1)
    assert snap.budget_refusals == 2


class SlowLimiter:
    """A CallLimiter on fake time: each permit costs ``delay`` seconds; over ``timeout`` it refuses."""

    def __init__(self, fake_time: Any, delay: float) -> None:
        self.fake_time, self.delay, self.settled = fake_time, delay, 0

    def acquire_for(self, request: Any, *, timeout: float | None) -> SlowLimiter:
        if timeout is not None and self.delay > timeout:
            raise RateLimitTimeout(f"would wait {self.delay} s")
        self.fake_time.now += self.delay
        return self

    async def acquire_for_async(self, request: Any, *, timeout: float | None) -> SlowLimiter:
        return self.acquire_for(request, timeout=timeout)

    def settle(self, *, status: int | None, body: bytes | None) -> None:
        self.settled += 1


@pytest.mark.parametrize("is_async", [False, True])
async def test_limiter_waits_and_timeouts(lib: ModuleType, fake_time: Any, is_async: bool) -> None:
    limiter = SlowLimiter(fake_time, delay=0.75)
    policy = RetryPolicy(max_attempts=3, deadline=5.0, base_delay=0.1, max_delay=0.1, max_retry_after=60)
    client, engine = engine_client(
        lib, script(lib, (429, "0"), (200,)), fake_time, is_async=is_async, limiter=limiter, policy=policy
    )

    async def get(path: str) -> Any:
        return (await client.get(path)) if is_async else client.get(path)

    assert (await get("/x")).status_code == 200
    snap = engine.stats.snapshot()
    assert (snap.limiter_acquisitions, snap.limiter_waits, snap.limiter_timeouts) == (2, 2, 0)
    assert snap.limiter_wait_seconds == pytest.approx(1.5)

    limiter.delay = 10.0  # longer than the 5 s deadline: refused before sending
    with pytest.raises(RateLimitTimeout):
        await get("/y")
    await client.aclose() if is_async else client.close()
    snap = engine.stats.snapshot()
    assert (snap.calls, snap.failed_calls, snap.attempts, snap.limiter_timeouts) == (2, 1, 2, 1)


async def test_a_cancelled_call_counts_as_cancelled(lib: ModuleType, fake_time: Any) -> None:
    entered = asyncio.Event()

    async def hang(request: Any) -> Any:
        entered.set()
        await asyncio.Event().wait()

    client, engine = engine_client(lib, hang, fake_time, is_async=True)
    async with client:
        task = asyncio.create_task(client.get("/x"))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    snap = engine.stats.snapshot()
    assert (snap.calls, snap.cancelled_calls, snap.failed_calls, snap.attempts) == (1, 1, 0, 0)


def test_a_broken_observer_does_not_break_calls(
    lib: ModuleType, fake_time: Any, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(CallObserver):
        def call_ended(self, outcome: str, attempts: int) -> None:
            raise RuntimeError("observer bug")

        def retrying(self, event: RetryEvent) -> None:
            raise RuntimeError("observer bug")

    client, engine = engine_client(lib, script(lib, (429, "1"), (200,)), fake_time)
    engine.watchers.subscribe(Broken())
    with client:
        assert client.get("/x").status_code == 200
    assert engine.stats.snapshot().retries == 1  # stats (subscribed first) still counted
    assert len([r for r in caplog.records if "observer" in r.getMessage() and r.exc_info]) == 2


# -- through wrap() ------------------------------------------------------------------


@pytest.fixture
def http(lib: ModuleType) -> ModuleType:
    if lib.__name__ == "httpx2" and not OPENAI3:
        pytest.skip("openai 2.x takes httpx clients only")
    return lib


def openai_client(http: ModuleType, handler: Handler) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="sk-test",
        base_url="http://llm.test/v1",
        http_client=http.Client(transport=http.MockTransport(handler)),
    )


def test_wrapped_client_stats(http: ModuleType) -> None:
    waits: list[float] = []
    wrapped = wrap(
        openai_client(http, script(http, (429, "1"), (429, "1"), (200,))),
        RetryPolicy(max_attempts=5),
        on_retry=lambda e: waits.append(e.wait),
    )
    stats = client_stats(wrapped)
    with instant_retries():
        wrapped.models.list()
    snap = stats.snapshot()
    assert (snap.calls, snap.attempts, snap.retries, dict(snap.retries_by_reason)) == (
        1,
        3,
        2,
        {"status 429": 2},
    )
    assert snap.retry_wait_seconds == pytest.approx(
        sum(waits)
    )  # counted although instant_retries skipped them
    # Derived clients share the transport, hence the counters.
    derived = wrapped.with_options(timeout=5.0)
    assert client_stats(derived) is stats
    assert client_stats(wrapped.copy()) is stats
    # Wrapping again makes a new client with counters of its own.
    assert client_stats(wrap(wrapped)) is not stats
    assert call_observers(wrapped).observers[0] is stats


def test_clients_sharing_a_hook_list_keep_separate_stats(http: ModuleType) -> None:
    shared = RetryObservers()
    seen: list[RetryEvent] = []
    shared.subscribe(seen.append)
    a = wrap(openai_client(http, script(http, (503,), (200,))), on_retry=shared)
    b = wrap(openai_client(http, script(http, (200,))), on_retry=shared)
    with instant_retries():
        a.models.list()
        b.models.list()
        b.models.list()
    assert len(seen) == 1
    assert (client_stats(a).calls, client_stats(a).retries) == (1, 1)
    assert (client_stats(b).calls, client_stats(b).retries) == (2, 0)


def test_real_limiter_wait_is_counted(http: ModuleType) -> None:
    # 20 permits/s, burst 1: the second call waits (up to 50 ms) for its permit.
    limiter = RateLimiter(requests_per_second=20, burst=1)
    wrapped = wrap(openai_client(http, script(http, (200,))), limiter=limiter)
    wrapped.models.list()
    wrapped.models.list()
    snap = client_stats(wrapped).snapshot()
    assert snap.limiter_acquisitions == 2
    assert snap.limiter_waits >= 1
    assert snap.limiter_wait_seconds > 0


def test_only_wrapped_clients_have_stats(http: ModuleType) -> None:
    from llm_backoff import UnsupportedClientError

    with pytest.raises(UnsupportedClientError):
        client_stats(openai_client(http, script(http, (200,))))
    with pytest.raises(UnsupportedClientError):
        client_stats(object())  # type: ignore[arg-type]
