"""Early refusals through a real shim on loopback: budgets that cannot cover the service, waits
beyond --max-queue-wait. The decisions themselves are tested with a fake clock in test_admission."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from llm_backoff_shim.serve.request_path.intake import asks_for_stream, parse_json_object

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def post(
    url: str, headers: dict[str, str] | None = None, body: dict[str, Any] | None = None
) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body or CHAT, headers=headers or {}, timeout=10.0)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"model": "m", "stream": true}', True),
        (b'{"model":"m","stream":false}', False),
        (b'{"model": "m"}', False),
        (b'{"messages": [{"content": "say \\"stream\\": true"}]}', False),  # the word in a prompt
        (b'{"stream": "true"}', False),  # only a JSON true asks for a stream
        (b'{"stream": 1}', False),
    ],
)
def test_asks_for_stream(body: bytes, expected: bool) -> None:
    parsed = parse_json_object(body)
    assert isinstance(parsed, dict)
    assert asks_for_stream(parsed) is expected


def test_only_streams_feed_the_first_token_estimate(
    upstream: Any, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(upstream.url, max_concurrency=2)
    estimator = shim.runtime.controller.estimator
    assert post(shim.url).status_code == 200
    # The sample is taken when the slot is released, just after the answer has gone out.
    waiter(lambda: estimator.samples >= 1, what="the completion's sample")
    assert estimator.samples == 1
    assert estimator.first_byte_time is None  # a non-streaming body's first byte is its end
    streamed = post(shim.url, {"x-fake-chunks": "3"}, {**CHAT, "stream": True})
    assert streamed.status_code == 200
    assert estimator.first_byte_time is not None


def test_budget_below_the_measured_service_time_never_reaches_the_engine(
    upstream: Any, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(upstream.url, max_concurrency=2)
    # One measured completion of at least 0.3 s: the fake upstream sleeps before answering.
    assert post(shim.url, {"x-fake-delay": "0.3"}).status_code == 200
    waiter(lambda: shim.runtime.controller.estimator.samples >= 1, what="the completion's sample")
    assert shim.runtime.controller.estimator.service_time >= 0.3
    seen = len(upstream.received)
    refused = post(shim.url, {"x-request-timeout-ms": "50"})  # a slot is free, the time is not
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "queue_timeout"
    assert "cannot cover the expected service time" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert len(upstream.received) == seen  # no engine work started for it
    assert shim.state() == {"interactive": (0, 0), "batch": (0, 0)}


def test_wait_beyond_max_queue_wait_is_refused_without_queueing(
    upstream: Any, make_shim: Callable[..., Any], waiter: Any
) -> None:
    shim = make_shim(upstream.url, max_concurrency=1, max_queue=10, max_queue_wait=0.3)
    # Measured service >= 1 s with one slot: the first queued caller expects > 0.3 s as long as
    # the held request has run under 0.7 s when it arrives (the wait counts to the expected end
    # of the request in flight). With 0.6 s and a 0.5 s limit the margin was 0.1 s, and a
    # loaded CI machine once took longer: the caller was queued and timed out instead.
    assert post(shim.url, {"x-fake-delay": "1.0"}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, shim.url, {"x-fake-hold": "1"})
        waiter(lambda: shim.state()["interactive"] == (1, 0), what="slot taken")
        refused = post(shim.url)
        # Told at once rather than after holding a queue place for 0.3 s: nothing was queued.
        assert shim.state()["interactive"] == (1, 0)
        upstream.release()
        assert held.result().status_code == 200
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "queue_full"
    assert "exceeds the 0.3 s limit" in error["message"]
    assert error["retry_after_seconds"] > 0
    assert shim.state() == {"interactive": (0, 0), "batch": (0, 0)}


def test_a_budget_to_begin_is_held_against_the_first_token_not_the_whole_stream(
    upstream: Any, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(upstream.url, max_concurrency=2)
    estimator = shim.runtime.controller.estimator
    slow_stream = {"x-fake-chunks": "6", "x-fake-step": "0.2"}
    # One measured stream: its first byte comes at once, its end after at least 1 s.
    assert post(shim.url, slow_stream, {**CHAT, "stream": True}).status_code == 200
    waiter(lambda: estimator.samples >= 1, what="the completion's sample")
    assert estimator.service_time >= 1.0
    budget = {"x-request-timeout-ms": "400"}
    # For the whole call, 0.4 s cannot cover the stream: refused without engine work.
    seen = len(upstream.received)
    whole = post(shim.url, {**slow_stream, **budget}, {**CHAT, "stream": True})
    assert whole.status_code == 429
    assert "cannot cover the expected service time" in whole.json()["error"]["message"]
    assert len(upstream.received) == seen
    # To begin, it covers the first token: served, and the stream runs past the 0.4 s.
    begun = post(
        shim.url, {**slow_stream, **budget, "x-request-timeout-scope": "start"}, {**CHAT, "stream": True}
    )
    assert begun.status_code == 200
    assert begun.text.count("data:") >= 6
    # A non-streaming answer begins only at its end: the whole service is still needed.
    plain = post(shim.url, {**budget, "x-request-timeout-scope": "start"})
    assert plain.status_code == 429
    waiter(lambda: shim.state() == {"interactive": (0, 0), "batch": (0, 0)}, what="slots back")
