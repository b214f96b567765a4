"""A fleet of wrapped openai clients with adaptive limiters against a real loopback server.

The server admits ``CAPACITY`` requests per second (a token bucket) and answers the
rest with a plain 429 without any Retry-After hint, so only the clients' adaptive
rates can keep them from hammering it. Each client is greedy (one thread calling in
a loop) and has its own ``RateLimiter(adaptive=True)``, like independent processes.
Bounded: a few seconds, a few hundred requests, 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import llm_backoff
from llm_backoff import RetryPolicy
from llm_backoff.errors import RateLimitTimeout
from llm_backoff.ratelimit import BucketState, RateLimiter

CAPACITY = 20.0
CLIENTS = 3
SECONDS = 4.0

COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}


@dataclass
class Server:
    bucket: BucketState = field(default_factory=lambda: BucketState(CAPACITY, 2.0, 2.0, time.monotonic()))
    outcomes: list[tuple[float, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            await request.body()
            now = time.monotonic()
            with self.lock:
                self.bucket.refill(now)
                admitted = self.bucket.tokens >= 1.0
                if admitted:
                    self.bucket.take(1.0)
                self.outcomes.append((now, 200 if admitted else 429))
            if admitted:
                return JSONResponse(COMPLETION)
            error = {"message": "over capacity", "type": "rate_limit_exceeded", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=429)

        return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


def run_fleet(url: str, make_limiter: Callable[[], RateLimiter | None], seconds: float) -> None:
    policy = RetryPolicy(max_attempts=3, deadline=1.0, base_delay=0.02, max_delay=0.2)
    stop = [0.0]

    def start_clock() -> None:
        stop[0] = time.monotonic() + seconds

    # The window starts once every client is built (slow on a busy machine).
    ready = threading.Barrier(CLIENTS + 1, action=start_clock)

    def client_loop() -> None:
        limiter = make_limiter()
        base = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=5.0)
        kwargs: dict[str, Any] = {"limiter": limiter} if limiter is not None else {}
        client = llm_backoff.wrap(base, policy, **kwargs)
        try:
            ready.wait()
            while time.monotonic() < stop[0]:
                # Rejected, or out of time on a loaded machine: the server keeps the count.
                with contextlib.suppress(openai.APIError, RateLimitTimeout):
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        finally:
            client.close()
            base.close()

    threads = [threading.Thread(target=client_loop) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    ready.wait()
    for t in threads:
        t.join(seconds + 30)


def second_half(server: Server, seconds: float) -> tuple[float, float, float, list[int]]:
    """Over the second half: admitted/s, offered/s, share rejected, admitted per 1 s window."""
    with server.lock:
        outcomes = list(server.outcomes)
    start = outcomes[0][0]
    late = [(t - start, s) for t, s in outcomes if t - start >= seconds / 2]
    ok = sum(1 for _, s in late if s == 200)
    windows = [
        sum(1 for t, s in late if s == 200 and lo <= t < lo + 1.0)
        for lo in range(int(seconds / 2), int(seconds))
    ]
    half = seconds / 2
    return ok / half, len(late) / half, (len(late) - ok) / max(len(late), 1), windows


@pytest.mark.slow
def test_adaptive_fleet_settles_near_capacity_blind_fleet_does_not(serve: Callable[[Any], str]) -> None:
    blind = Server()
    run_fleet(serve(blind.app()), lambda: None, 2.0)
    blind_admitted, blind_offered, blind_rejected, _ = second_half(blind, 2.0)
    if blind_offered < 1.5 * CAPACITY:
        pytest.skip(f"machine too busy to overload the server ({blind_offered:.0f} requests/s offered)")

    server = Server()
    run_fleet(serve(server.app()), lambda: RateLimiter(adaptive=True, min_rate=1.0), SECONDS)
    admitted, offered, rejected, windows = second_half(server, SECONDS)
    print(
        f"capacity {CAPACITY:.0f}/s; blind: {blind_offered:.1f}/s offered, {blind_admitted:.1f}/s admitted, "
        f"{blind_rejected:.0%} rejected; adaptive: {offered:.1f}/s offered, {admitted:.1f}/s admitted, "
        f"{rejected:.0%} rejected, admitted per second {windows}"
    )
    # Greedy clients that only retry with backoff get a large share of 429s...
    assert blind_rejected > 0.3
    # ...adaptive ones send close to what the server can take: few 429s,
    assert rejected < blind_rejected / 2
    # while keeping it busy (compared with what the blind fleet got through).
    assert admitted >= 0.6 * blind_admitted
