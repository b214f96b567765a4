"""The retrying transports, sync and async, over httpx and httpx2 MockTransports.

Time is fake (``fake_time``): waits advance a clock instead of sleeping.
"""

from __future__ import annotations

import contextvars
import gzip
import json
import logging
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from llm_backoff import RateLimitTimeout, RetryEvent, RetryPolicy
from llm_backoff.testing import instant_retries

Handler = Callable[[Any], Any]


def transports(lib: ModuleType) -> tuple[type[Any], type[Any]]:
    from llm_backoff import transport

    if lib.__name__ == "httpx2":
        return transport.Httpx2RetryTransport, transport.AsyncHttpx2RetryTransport
    return transport.HttpxRetryTransport, transport.AsyncHttpxRetryTransport


def sync_client(
    lib: ModuleType, handler: Handler, policy: RetryPolicy | None, fake_time: Any, **kw: Any
) -> Any:
    sync_cls, _ = transports(lib)
    options = {**fake_time.engine_options(), **kw}
    return lib.Client(
        transport=sync_cls(lib.MockTransport(handler), policy, **options), base_url="http://api"
    )


def async_client(
    lib: ModuleType, handler: Handler, policy: RetryPolicy | None, fake_time: Any, **kw: Any
) -> Any:
    _, async_cls = transports(lib)
    options = {**fake_time.engine_options(), **kw}
    return lib.AsyncClient(
        transport=async_cls(lib.MockTransport(handler), policy, **options), base_url="http://api"
    )


def scripted(lib: ModuleType, *responses: Any) -> tuple[Handler, list[Any]]:
    """A handler answering ``responses`` in order (an exception class is raised), recording requests."""
    seen: list[Any] = []

    def handler(request: Any) -> Any:
        seen.append(request)
        item = responses[min(len(seen), len(responses)) - 1]
        if isinstance(item, type) and issubclass(item, Exception):
            raise item("scripted failure", request=request)
        return item

    return handler, seen


def busy(lib: ModuleType, retry_after: str = "2", status: int = 429, **extra: str) -> Any:
    return lib.Response(
        status,
        headers={"retry-after": retry_after, **extra},
        json={"error": {"message": "busy", "type": "server_overloaded", "code": "queue_full"}},
    )


def ok(lib: ModuleType) -> Any:
    return lib.Response(200, json={"ok": True})


def test_retries_429_with_hint_then_succeeds(lib: ModuleType, fake_time: Any) -> None:
    events: list[RetryEvent] = []
    handler, seen = scripted(lib, busy(lib, "2"), busy(lib, "3"), ok(lib))
    with sync_client(lib, handler, RetryPolicy(), fake_time, on_retry=events.append) as client:
        response = client.post("/v1/chat", json={"q": 1})
    assert response.status_code == 200
    assert response.json() == {"ok": True}
    assert len(seen) == 3
    # the hint is a floor, plus at most 20 % extra
    assert 2.0 <= fake_time.sleeps[0] <= 2.4
    assert 3.0 <= fake_time.sleeps[1] <= 3.6
    attempts = response.extensions["llm_backoff.attempts"]
    assert [a.status for a in attempts] == [429, 429, 200]
    assert [a.wait for a in attempts] == [*fake_time.sleeps, None]
    assert [a.hint for a in attempts] == [2.0, 3.0, None]
    assert [(e.attempt, e.hint, e.wait) for e in events] == [
        (1, 2.0, fake_time.sleeps[0]),
        (2, 3.0, fake_time.sleeps[1]),
    ]
    assert events[1].elapsed == pytest.approx(fake_time.sleeps[0])
    assert events[0].method == "POST"
    assert events[0].url.endswith("/v1/chat")


def test_request_body_is_replayed_on_every_attempt(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, busy(lib, "1"), busy(lib, "1", status=503), ok(lib))

    def body() -> Iterator[bytes]:  # a one-shot generator: only readable once
        yield b'{"prompt": '
        yield b'"hello"}'

    with sync_client(lib, handler, RetryPolicy(), fake_time) as client:
        assert client.post("/v1/x", content=body()).status_code == 200
    assert [r.content for r in seen] == [b'{"prompt": "hello"}'] * 3


def test_deadline_header_and_timeouts_shrink_with_time_left(lib: ModuleType, fake_time: Any) -> None:
    handler, _ = scripted(lib, busy(lib, "4"), busy(lib, "4"), ok(lib))
    timeouts: list[dict[str, float]] = []
    budgets: list[str] = []

    def recording(request: Any) -> Any:
        # the transport re-stamps the same request object: copy what each attempt carried
        timeouts.append(dict(request.extensions["timeout"]))
        budgets.append(request.headers["x-request-timeout-ms"])
        return handler(request)

    policy = RetryPolicy(deadline=20, retry_after_jitter=0)
    with sync_client(lib, recording, policy, fake_time) as client:
        client.timeout = lib.Timeout(30.0, connect=5.0)
        assert client.get("/v1/models").status_code == 200
    assert budgets == ["20000", "16000", "12000"]
    assert timeouts[0] == {"connect": 5.0, "read": 20.0, "write": 20.0, "pool": 20.0}
    assert timeouts[2] == {"connect": 5.0, "read": 12.0, "write": 12.0, "pool": 12.0}


def test_timeout_header_is_capped_by_a_shorter_read_timeout(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, ok(lib))
    with sync_client(lib, handler, RetryPolicy(deadline=60), fake_time) as client:
        client.get("/x", timeout=lib.Timeout(5.0, read=2.5))
    assert seen[0].headers["x-request-timeout-ms"] == "2500"


def test_each_retry_is_logged_at_info(
    lib: ModuleType, fake_time: Any, caplog: pytest.LogCaptureFixture
) -> None:
    handler, _ = scripted(lib, busy(lib, "1"), ok(lib))
    with (
        caplog.at_level(logging.DEBUG, logger="llm_backoff"),
        sync_client(lib, handler, RetryPolicy(), fake_time) as client,
    ):
        client.get("/x")
    records = [r for r in caplog.records if r.name == "llm_backoff"]
    assert [r.levelno for r in records] == [logging.INFO, logging.DEBUG]
    assert "attempt 1 failed (status 429); retrying in" in records[0].getMessage()
    assert "server hint 1 s" in records[0].getMessage()


def test_no_deadline_sends_no_timeout_header(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, ok(lib))
    with sync_client(lib, handler, RetryPolicy(deadline=None), fake_time) as client:
        client.get("/x")
    assert "x-request-timeout-ms" not in seen[0].headers


def test_wait_that_would_cross_the_deadline_raises_at_once(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, busy(lib, "8"), ok(lib))
    with sync_client(lib, handler, RetryPolicy(deadline=5), fake_time) as client:
        response = client.get("/x")
    assert response.status_code == 429
    assert len(seen) == 1
    assert fake_time.sleeps == []  # no pointless sleep
    assert "deadline" in response.extensions["llm_backoff.reason"]


def test_hint_above_max_retry_after_is_not_retried(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, busy(lib, "500"), ok(lib))
    with sync_client(lib, handler, RetryPolicy(deadline=None), fake_time) as client:
        response = client.get("/x")
    assert response.status_code == 429
    assert len(seen) == 1
    assert "max_retry_after" in response.extensions["llm_backoff.reason"]


def test_retry_after_ms_and_body_hints(lib: ModuleType, fake_time: Any) -> None:
    first = lib.Response(503, headers={"retry-after-ms": "1500", "retry-after": "9"})
    second = lib.Response(503, json={"error": {"retry_after_seconds": 2.5}})
    handler, _ = scripted(lib, first, second, ok(lib))
    policy = RetryPolicy(retry_after_jitter=0)
    with sync_client(lib, handler, policy, fake_time) as client:
        response = client.get("/x")
    assert [a.hint for a in response.extensions["llm_backoff.attempts"]] == [1.5, 2.5, None]
    assert fake_time.sleeps == [1.5, 2.5]


def test_gzip_error_body_is_decoded_for_hints_and_still_readable(lib: ModuleType, fake_time: Any) -> None:
    payload = json.dumps({"error": {"message": "later", "retry_after_seconds": 3}}).encode()
    zipped = lib.Response(
        429,
        headers={"content-encoding": "gzip", "content-type": "application/json"},
        content=gzip.compress(payload),
    )
    handler, _ = scripted(lib, zipped)
    policy = RetryPolicy(max_attempts=1)
    with sync_client(lib, handler, policy, fake_time) as client:
        response = client.get("/x")
    assert response.json()["error"]["message"] == "later"
    assert response.extensions["llm_backoff.attempts"][0].hint == 3.0


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_client_errors_are_returned_at_once(lib: ModuleType, fake_time: Any, status: int) -> None:
    handler, seen = scripted(lib, lib.Response(status, headers={"x-should-retry": "true"}, json={}))
    with sync_client(lib, handler, RetryPolicy(), fake_time) as client:
        assert client.get("/x").status_code == status
    assert len(seen) == 1


def test_x_should_retry_false_and_insufficient_quota(lib: ModuleType, fake_time: Any) -> None:
    quota = lib.Response(429, json={"error": {"type": "insufficient_quota", "code": "insufficient_quota"}})
    handler, seen = scripted(lib, busy(lib, "1", **{"x-should-retry": "false"}), quota)
    with sync_client(lib, handler, RetryPolicy(), fake_time) as client:
        assert client.get("/x").status_code == 429
        assert client.get("/x").status_code == 429
    assert len(seen) == 2


def test_connection_errors_are_retried_then_raised_with_history(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, lib.ConnectError, lib.RemoteProtocolError, lib.ConnectError)
    policy = RetryPolicy(max_attempts=3)
    with sync_client(lib, handler, policy, fake_time) as client, pytest.raises(lib.ConnectError) as info:
        client.get("/x")
    assert len(seen) == 3
    attempts = info.value.llm_backoff_attempts
    assert [a.error for a in attempts] == [
        "ConnectError: scripted failure",
        "RemoteProtocolError: scripted failure",
        "ConnectError: scripted failure",
    ]
    assert "max_attempts (3)" in info.value.__notes__[0]


def test_timeouts_follow_the_policy_switch(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, lib.ReadTimeout, ok(lib))
    with sync_client(lib, handler, RetryPolicy(), fake_time) as client:
        assert client.get("/x").status_code == 200
    handler, seen = scripted(lib, lib.ReadTimeout, ok(lib))
    policy = RetryPolicy(retry_timeouts=False)
    with sync_client(lib, handler, policy, fake_time) as client, pytest.raises(lib.ReadTimeout):
        client.get("/x")
    assert len(seen) == 1


def test_a_bug_in_the_handler_is_not_retried(lib: ModuleType, fake_time: Any) -> None:
    calls = []

    def handler(request: Any) -> Any:
        calls.append(request)
        raise ValueError("bug")

    with (
        sync_client(lib, handler, RetryPolicy(), fake_time) as client,
        pytest.raises(ValueError, match="bug"),
    ):
        client.get("/x")
    assert len(calls) == 1


def test_json_body_cut_midway_is_a_failed_attempt_and_retried(
    lib: ModuleType, broken_stream: Callable[..., Any], fake_time: Any
) -> None:
    stream = broken_stream(lib, [b'{"choices": ['])
    cut = lib.Response(200, headers={"content-type": "application/json"}, stream=stream)
    handler, seen = scripted(lib, cut, ok(lib))
    with sync_client(lib, handler, RetryPolicy(), fake_time) as client:
        response = client.get("/x")
    assert response.json() == {"ok": True}
    assert len(seen) == 2
    assert stream.closed
    assert response.extensions["llm_backoff.attempts"][0].error == "ReadError: connection reset mid-body"


def test_event_stream_cut_midway_is_raised_not_retried(
    lib: ModuleType, broken_stream: Callable[..., Any], fake_time: Any
) -> None:
    stream = broken_stream(lib, [b"data: one\n\n", b"data: two\n\n"])
    sse = lib.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)
    handler, seen = scripted(lib, sse, ok(lib))
    received: list[bytes] = []
    with (
        sync_client(lib, handler, RetryPolicy(), fake_time) as client,
        client.stream("POST", "/v1/chat", json={"stream": True}) as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_bytes()
        received.append(next(chunks))
        received.append(next(chunks))
        with pytest.raises(lib.ReadError):
            next(chunks)
    assert b"".join(received) == b"data: one\n\ndata: two\n\n"
    assert len(seen) == 1


def test_event_stream_rejected_before_start_is_retried(lib: ModuleType, fake_time: Any) -> None:
    sse = lib.Response(200, headers={"content-type": "text/event-stream"}, content=b"data: hi\n\n")
    handler, seen = scripted(lib, busy(lib, "1"), sse)
    with (
        sync_client(lib, handler, RetryPolicy(), fake_time) as client,
        client.stream("POST", "/v1/chat") as response,
    ):
        assert response.read() == b"data: hi\n\n"
    assert len(seen) == 2


def test_request_class_header(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, ok(lib))
    with sync_client(lib, handler, RetryPolicy(), fake_time, request_class="batch") as client:
        client.get("/x")
        client.get("/x", headers={"x-request-class": "interactive"})
    assert [r.headers["x-request-class"] for r in seen] == ["batch", "interactive"]


def test_request_class_must_be_a_header_value(lib: ModuleType, fake_time: Any) -> None:
    with pytest.raises(ValueError, match="request_class"):
        sync_client(lib, scripted(lib, ok(lib))[0], None, fake_time, request_class="a\r\nb")


def test_instant_retries_skip_sleeping_and_cap_attempts(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, busy(lib, "30"))
    with sync_client(lib, handler, RetryPolicy(deadline=None), fake_time) as client:
        with instant_retries(max_attempts=3):
            response = client.get("/x")
        assert len(seen) == 3
        assert fake_time.sleeps == []
        waits = [a.wait for a in response.extensions["llm_backoff.attempts"]]
        assert waits[0] is not None
        assert waits[0] >= 30  # still computed and recorded
        seen.clear()
        client.get("/x")  # outside the block: real (fake-clock) waits and the policy's 10 attempts
        assert len(seen) == 10
        assert len(fake_time.sleeps) == 9


class FakePermit:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def settle(self, *, status: int | None, body: bytes | None) -> None:
        self.log.append(("settle", status, body))


class FakeLimiter:
    def __init__(self, refuse_after: int | None = None) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.refuse_after = refuse_after

    def _acquire(self, timeout: float | None) -> FakePermit:
        if self.refuse_after is not None and sum(e[0] == "acquire" for e in self.log) >= self.refuse_after:
            raise RateLimitTimeout(f"no permit within {timeout} s")
        self.log.append(("acquire", timeout))
        return FakePermit(self.log)

    def acquire_for(self, request: Any, *, timeout: float | None) -> FakePermit:
        return self._acquire(timeout)

    async def acquire_for_async(self, request: Any, *, timeout: float | None) -> FakePermit:
        return self._acquire(timeout)


class FakeBudget:
    def __init__(self, credits: int) -> None:
        self.credits = credits
        self.requests = 0

    def record_request(self) -> None:
        self.requests += 1

    def try_spend(self) -> bool:
        self.credits -= 1
        return self.credits >= 0


def test_limiter_is_asked_per_attempt_and_settled_with_bodies(lib: ModuleType, fake_time: Any) -> None:
    limiter = FakeLimiter()
    usage = {"usage": {"total_tokens": 7}}
    handler, _ = scripted(lib, busy(lib, "1"), lib.ConnectError, lib.Response(200, json=usage))
    policy = RetryPolicy(deadline=30, retry_after_jitter=0, jitter="none", base_delay=2)
    with sync_client(lib, handler, policy, fake_time, limiter=limiter) as client:
        assert client.post("/v1/chat", json={}).json() == usage
    kinds = [e[0] for e in limiter.log]
    assert kinds == ["acquire", "settle", "acquire", "settle", "acquire", "settle"]
    # waits: the 429's hint (1 s), then base_delay * 2**1 after the second attempt's error
    assert [e[1] for e in limiter.log if e[0] == "acquire"] == [30.0, 29.0, 25.0]
    settles = [e for e in limiter.log if e[0] == "settle"]
    assert settles[0][1] == 429
    assert json.loads(settles[0][2])["error"]["code"] == "queue_full"
    assert settles[1] == ("settle", None, None)
    assert settles[2][:2] == ("settle", 200)
    assert json.loads(settles[2][2]) == usage


def test_limiter_sees_the_tail_of_an_event_stream_on_close(lib: ModuleType, fake_time: Any) -> None:
    limiter = FakeLimiter()
    chunks = [b"data: %d\n\n" % i for i in range(20_000)] + [b'data: {"usage": {"total_tokens": 3}}\n\n']
    sse = lib.Response(200, headers={"content-type": "text/event-stream"}, content=iter(chunks))
    handler, _ = scripted(lib, sse)
    with (
        sync_client(lib, handler, RetryPolicy(), fake_time, limiter=limiter) as client,
        client.stream("POST", "/v1/chat") as response,
    ):
        parts = response.iter_raw()
        first = next(parts)
        assert [e[0] for e in limiter.log] == ["acquire"]  # not before the stream ends
        body = first + b"".join(parts)
    assert body == b"".join(chunks)
    (_, status, tail) = limiter.log[-1]
    assert status == 200
    assert len(tail) == 64 * 1024
    assert body.endswith(tail)
    assert tail.endswith(b'{"usage": {"total_tokens": 3}}\n\n')


def test_limiter_timeout_propagates_typed_with_history(lib: ModuleType, fake_time: Any) -> None:
    limiter = FakeLimiter(refuse_after=1)
    handler, seen = scripted(lib, busy(lib, "1"), ok(lib))
    with (
        sync_client(lib, handler, RetryPolicy(), fake_time, limiter=limiter) as client,
        pytest.raises(RateLimitTimeout, match="no permit") as info,
    ):
        client.get("/x")
    assert len(seen) == 1
    assert [a.status for a in info.value.llm_backoff_attempts] == [429]


def test_budget_records_first_attempts_and_stops_retries(lib: ModuleType, fake_time: Any) -> None:
    budget = FakeBudget(credits=1)
    handler, seen = scripted(lib, busy(lib, "1"))
    with sync_client(lib, handler, RetryPolicy(), fake_time, budget=budget) as client:
        response = client.get("/x")
    assert budget.requests == 1
    assert len(seen) == 2
    assert "budget" in response.extensions["llm_backoff.reason"]


def test_closing_a_non_owning_transport_keeps_the_inner_open(lib: ModuleType, fake_time: Any) -> None:
    sync_cls, _ = transports(lib)
    closed: list[bool] = []

    class Inner(lib.MockTransport):  # type: ignore[misc, name-defined]
        def close(self) -> None:
            closed.append(True)

    handler, _ = scripted(lib, ok(lib))
    sync_cls(Inner(handler), owns_inner=False).close()
    assert closed == []
    sync_cls(Inner(handler)).close()
    assert closed == [True]


def test_many_threads_share_one_transport(lib: ModuleType) -> None:
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def handler(request: Any) -> Any:
        key = request.headers["x-id"]
        with lock:
            counts[key] = counts.get(key, 0) + 1
            n = counts[key]
        return busy(lib, "0.001") if n < 3 else ok(lib)

    events: list[RetryEvent] = []
    sync_cls, _ = transports(lib)
    client = lib.Client(transport=sync_cls(lib.MockTransport(handler), on_retry=events.append))

    def worker(i: int) -> None:
        for j in range(10):
            assert client.get("http://api/x", headers={"x-id": f"{i}-{j}"}).status_code == 200

    with instant_retries():
        # contextvars do not flow into new threads: run each worker in a copy of this context
        threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(worker, i)) for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(counts.values()) == [3] * 80
    assert len(events) == 160


# -- async ---------------------------------------------------------------------------


async def test_async_retries_then_succeeds_with_history(lib: ModuleType, fake_time: Any) -> None:
    events: list[RetryEvent] = []
    handler, seen = scripted(lib, busy(lib, "2"), lib.ReadTimeout, ok(lib))
    async with async_client(lib, handler, RetryPolicy(), fake_time, on_retry=events.append) as client:
        response = await client.post("/v1/chat", content=b"payload")
    assert response.json() == {"ok": True}
    assert [r.content for r in seen] == [b"payload"] * 3
    assert [a.status for a in response.extensions["llm_backoff.attempts"]] == [429, None, 200]
    assert len(fake_time.sleeps) == 2
    assert fake_time.sleeps[0] >= 2
    assert [e.reason for e in events] == ["status 429", "timeout (ReadTimeout)"]


async def test_async_gives_up_raising_the_original_exception(lib: ModuleType, fake_time: Any) -> None:
    handler, seen = scripted(lib, lib.ConnectError)
    async with async_client(lib, handler, RetryPolicy(max_attempts=2), fake_time) as client:
        with pytest.raises(lib.ConnectError) as info:
            await client.get("/x")
    assert len(info.value.llm_backoff_attempts) == 2
    assert len(seen) == 2


async def test_async_deadline_and_limiter(lib: ModuleType, fake_time: Any) -> None:
    limiter = FakeLimiter()
    handler, _ = scripted(lib, busy(lib, "3"), ok(lib))
    budgets: list[str] = []

    def recording(request: Any) -> Any:
        budgets.append(request.headers["x-request-timeout-ms"])
        return handler(request)

    policy = RetryPolicy(deadline=10, retry_after_jitter=0)
    async with async_client(lib, recording, policy, fake_time, limiter=limiter) as client:
        client.timeout = lib.Timeout(30.0)  # longer than the deadline: the deadline decides
        response = await client.get("/x")
    assert response.status_code == 200
    assert budgets == ["10000", "7000"]
    assert [e[1] for e in limiter.log if e[0] == "acquire"] == [10.0, 7.0]


async def test_async_json_cut_midway_is_retried_and_sse_cut_is_not(
    lib: ModuleType, broken_stream: Callable[..., Any], fake_time: Any
) -> None:
    cut = lib.Response(200, headers={"content-type": "application/json"}, stream=broken_stream(lib, [b"{"]))
    sse = lib.Response(
        200, headers={"content-type": "text/event-stream"}, stream=broken_stream(lib, [b"data: 1\n\n"])
    )
    handler, seen = scripted(lib, cut, sse, ok(lib))
    async with (
        async_client(lib, handler, RetryPolicy(), fake_time) as client,
        client.stream("GET", "/x") as response,
    ):
        with pytest.raises(lib.ReadError):
            await response.aread()
    assert len(seen) == 2  # the JSON cut was retried; the event stream cut was raised


async def test_async_sse_tail_settles_on_close(lib: ModuleType, fake_time: Any) -> None:
    limiter = FakeLimiter()
    sse = lib.Response(200, headers={"content-type": "text/event-stream"}, content=b"data: [DONE]\n\n")
    handler, _ = scripted(lib, sse)
    async with (
        async_client(lib, handler, RetryPolicy(), fake_time, limiter=limiter) as client,
        client.stream("GET", "/x") as response,
    ):
        await response.aread()
    assert limiter.log[-1] == ("settle", 200, b"data: [DONE]\n\n")
