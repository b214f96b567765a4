"""Returning callers first through a real shim on loopback: the header reaches admission."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def post(url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=10.0)


def test_a_retry_with_a_budget_is_served_before_fresh_requests_queued_earlier(
    upstream: Any, make_shim: Callable[..., Any], waiter: Any
) -> None:
    shim = make_shim(upstream.url, max_concurrency=1, max_queue=4, max_queue_wait=10)
    sent = [
        ("fresh", {}),
        ("unreadable-count", {"x-stainless-retry-count": "two", "x-request-timeout-ms": "30000"}),
        ("no-budget", {"x-stainless-retry-count": "1"}),
        ("returning", {"x-stainless-retry-count": "1", "x-request-timeout-ms": "30000"}),
    ]
    with ThreadPoolExecutor(len(sent) + 1) as pool:
        held = pool.submit(post, shim.url, {"x-fake-hold": "1", "x-request-id": "held"})
        waiter(lambda: shim.state()["interactive"] == (1, 0), what="slot taken")
        answers = []
        for n, (name, headers) in enumerate(sent, start=1):
            answers.append(pool.submit(post, shim.url, {**headers, "x-request-id": name}))
            waiter(lambda n=n: shim.state()["interactive"] == (1, n), what=f"{name} queued")
        upstream.release()
        assert held.result().status_code == 200
        assert [a.result().status_code for a in answers] == [200] * len(sent)
    ids = [dict(r.headers).get("x-request-id") for r in upstream.received]
    # Only the readable retry count with a budget goes first; the others keep arrival order.
    assert ids == ["held", "returning", "fresh", "unreadable-count", "no-budget"]
    forwarded = dict(upstream.received[1].headers)
    assert forwarded["x-stainless-retry-count"] == "1"  # passed on to the engine unchanged
    assert shim.state() == {"interactive": (0, 0), "batch": (0, 0)}
