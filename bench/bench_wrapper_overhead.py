"""Overhead of llm_backoff.wrap() on successful calls, against a bare openai client.

    .venv/bin/python bench/bench_wrapper_overhead.py [--rounds 41] [--calls 200] [--clock cpu|wall]
    .venv/bin/python bench/bench_wrapper_overhead.py --mode opcodes
    .venv/bin/python bench/bench_wrapper_overhead.py --mode quota [--window 60] [--windows 3]
        [--headers openai|anthropic|ietf] [--arms plain,off,paced]

Both clients on one in-process mock transport; rounds of ``--calls`` calls interleave bare and
wrapped. Reported: the median round's wrapped/bare ratio (IQR, distribution-free 95 % CI), the
pooled ratio and the ratio of the fastest rounds, in process CPU time (``--clock wall`` for quiet
machines). ``--mode opcodes`` counts bytecode instructions per call: blind to C, exact under load.

``--mode quota``: 8 threads on one client against a loopback server enforcing 60 requests and
40,000 LLM tokens (``estimate_tokens``) per ``--window`` seconds as token buckets (the shim's tenant
quotas), stated on every answer in the ``--headers`` family, refusals answered 429 with a
Retry-After. Each request asks for
650 tokens (about 663 estimated), so both limits nearly bind. Arms: ``plain`` (openai, its own
retries), ``off`` (``wrap(follow_rate_headers=False)``), ``paced`` (``wrap()``); the SDK arms with
a deadline of two windows. Reported per arm: refused attempts as a share of all, and requests
and tokens admitted as a share of the most the server could admit (a full bucket, then the
refill over the run: limit x (1 + run / window)).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import platform
import statistics
import sys
import time
from argparse import RawDescriptionHelpFormatter
from collections.abc import Callable
from functools import partial
from typing import Any

import openai

import llm_backoff

OPENAI3 = openai.__version__.startswith("3.")
if OPENAI3:
    import httpx2 as http
else:  # pragma: no cover - openai 2.x environment
    import httpx as http  # type: ignore[no-redef]

COMPLETION = (
    b'{"id": "c1", "object": "chat.completion", "created": 0, "model": "m", "choices": [{"index": 0, '
    b'"finish_reason": "stop", "message": {"role": "assistant", "content": "hello"}}], '
    b'"usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}'
)
MESSAGES: Any = [{"role": "user", "content": "Say hello in one word."}]


def handler(request: Any) -> Any:
    return http.Response(200, headers={"content-type": "application/json"}, content=COMPLETION)


CLIENT: Any = {"api_key": "sk-bench", "base_url": "http://bench/v1", "max_retries": 0}


def sync_pair() -> tuple[openai.OpenAI, openai.OpenAI]:
    bare = openai.OpenAI(**CLIENT, http_client=http.Client(transport=http.MockTransport(handler)))
    return bare, llm_backoff.wrap(bare)


def async_pair() -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    bare = openai.AsyncOpenAI(**CLIENT, http_client=http.AsyncClient(transport=http.MockTransport(handler)))
    return bare, llm_backoff.wrap(bare)


CLOCK: Callable[[], float] = time.process_time


def time_sync(client: openai.OpenAI, calls: int) -> float:
    start = CLOCK()
    for _ in range(calls):
        client.chat.completions.create(model="m", messages=MESSAGES)
    return CLOCK() - start


async def time_async(client: openai.AsyncOpenAI, calls: int) -> float:
    start = CLOCK()
    for _ in range(calls):
        await client.chat.completions.create(model="m", messages=MESSAGES)
    return CLOCK() - start


def run(
    name: str, bare: Callable[[], float], wrapped: Callable[[], float], rounds: int, calls: int
) -> dict[str, float]:
    bare(), wrapped()  # warm-up: imports, caches, pydantic models
    ratios, bare_t, wrapped_t = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            b, w = bare(), wrapped()
        else:
            w, b = wrapped(), bare()
        ratios.append(w / b)
        bare_t.append(b)
        wrapped_t.append(w)
        per_call = f"bare {b / calls * 1e6:7.1f} us/call, wrapped {w / calls * 1e6:7.1f} us/call"
        print(
            f"  {name} round {r + 1:>2}/{rounds}: {per_call}, ratio {w / b:.3f}", file=sys.stderr, flush=True
        )
    quartiles = statistics.quantiles(ratios, n=4)
    low, high = median_interval(ratios)
    return {
        "bare_us": min(bare_t) / calls * 1e6,
        "wrapped_us": min(wrapped_t) / calls * 1e6,
        "ratio": statistics.median(ratios),
        "q1": quartiles[0],
        "q3": quartiles[2],
        "ci_low": low,
        "ci_high": high,
        "pooled": sum(wrapped_t) / sum(bare_t),
        "ratio_of_min": min(wrapped_t) / min(bare_t),
    }


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free ~95 % confidence interval of the median (binomial order statistics)."""
    ordered = sorted(values)
    n = len(ordered)
    half_width = 0.98 * math.sqrt(n)
    low = max(0, math.floor(n / 2 - half_width))
    high = min(n - 1, math.ceil(n / 2 + half_width))
    return ordered[low], ordered[high]


def count_opcodes(call: Callable[[], Any], calls: int = 50) -> float:
    """Python opcodes executed per ``call()`` (after a warm-up), counted with a trace function."""
    executed = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal executed
        frame.f_trace_opcodes = True
        if event == "opcode":
            executed += 1
        return tracer

    for _ in range(20):
        call()
    for _ in range(calls):
        sys.settrace(tracer)
        try:
            call()
        finally:
            sys.settrace(None)
    return executed / calls


def opcodes_report() -> None:
    s_bare, s_wrapped = sync_pair()
    a_bare, a_wrapped = async_pair()
    loop = asyncio.new_event_loop()

    def sync_call(client: openai.OpenAI) -> Callable[[], Any]:
        return lambda: client.chat.completions.create(model="m", messages=MESSAGES)

    def async_call(client: openai.AsyncOpenAI) -> Callable[[], Any]:
        async def once() -> None:
            # the trace is switched on inside the task, so the loop's own steps count too
            await client.chat.completions.create(model="m", messages=MESSAGES)

        return lambda: loop.run_until_complete(once())

    print("| client | bare opcodes/call | wrapped opcodes/call | extra | extra % |")
    print("| --- | ---: | ---: | ---: | ---: |")
    try:
        for name, bare_call, wrapped_call in (
            ("sync", sync_call(s_bare), sync_call(s_wrapped)),
            ("async", async_call(a_bare), async_call(a_wrapped)),
        ):
            bare, wrapped = count_opcodes(bare_call), count_opcodes(wrapped_call)
            extra = f"{wrapped - bare:+.0f} | {(wrapped / bare - 1) * 100:+.2f} %"
            print(f"| {name} | {bare:.0f} | {wrapped:.0f} | {extra} |")
    finally:
        loop.close()


QUOTA_REQUESTS = 60
QUOTA_TOKENS = 40_000
QUOTA_ASK: Any = {
    "model": "m",
    "max_tokens": 650,
    "messages": [{"role": "user", "content": "Write a short poem about rate limits."}],
}


class QuotaServer:
    """``QUOTA_REQUESTS`` requests and ``QUOTA_TOKENS`` tokens per ``window`` s as token buckets (the
    shim's tenant quotas, OpenAI's and Anthropic's kind), stated on every answer."""

    def __init__(self, window: float, family: str) -> None:
        import threading

        from llm_backoff.ratelimit import BucketSpec, LocalStore

        self.window = window
        self.family = family
        self.store = LocalStore(
            (
                BucketSpec("requests", "requests", QUOTA_REQUESTS / window, QUOTA_REQUESTS),
                BucketSpec("tokens", "tokens", QUOTA_TOKENS / window, QUOTA_TOKENS),
            ),
            time.monotonic,
        )
        self.admitted = [0, 0.0]
        self.refused = 0
        self.lock = threading.Lock()

    def headers(self, levels: list[float]) -> dict[str, str]:
        out: dict[str, str] = {}
        limits = {"requests": QUOTA_REQUESTS, "tokens": QUOTA_TOKENS}
        for (name, limit), level in zip(limits.items(), levels, strict=True):
            remaining = max(0, math.floor(level))
            to_full = (limit - level) / limit * self.window
            if self.family == "openai":
                out[f"x-ratelimit-limit-{name}"] = str(limit)
                out[f"x-ratelimit-remaining-{name}"] = str(remaining)
                out[f"x-ratelimit-reset-{name}"] = f"{math.ceil(to_full * 1000)}ms"
            elif self.family == "anthropic":
                from datetime import datetime, timezone

                at = datetime.fromtimestamp(time.time() + to_full + 0.002, tz=timezone.utc)
                out[f"anthropic-ratelimit-{name}-limit"] = str(limit)
                out[f"anthropic-ratelimit-{name}-remaining"] = str(remaining)
                out[f"anthropic-ratelimit-{name}-reset"] = at.isoformat()
            else:
                policy = out.get("ratelimit-policy")
                item = f'"{name}";q={limit};w={math.ceil(self.window)}'
                out["ratelimit-policy"] = item if policy is None else f"{policy}, {item}"
                state = out.get("ratelimit")
                item = f'"{name}";r={remaining};t={math.ceil(to_full)}'
                out["ratelimit"] = item if state is None else f"{state}, {item}"
        return out

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        from llm_backoff.errors import RateLimitTimeout
        from llm_backoff.tokens import estimate_tokens

        async def answer(request: Request) -> Response:
            cost = float(estimate_tokens(await request.body()))
            with self.lock:
                try:
                    self.store.reserve((1.0, cost), 0.0)
                    admitted = True
                    self.admitted[0] += 1
                    self.admitted[1] += cost
                except RateLimitTimeout:
                    admitted = False
                    self.refused += 1
                levels = self.store.available()
            headers = self.headers(levels)
            if admitted:
                return Response(COMPLETION, media_type="application/json", headers=headers)
            wait = max((1.0 - levels[0]) / QUOTA_REQUESTS, (cost - levels[1]) / QUOTA_TOKENS) * self.window
            headers["retry-after-ms"] = str(math.ceil(max(wait, 0.001) * 1000))
            error = {"message": "quota", "type": "rate_limit_exceeded", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=429, headers=headers)

        return Starlette(routes=[Route("/v1/chat/completions", answer, methods=["POST"])])


def quota_arm(arm: str, window: float, windows: int, family: str) -> dict[str, float]:
    import contextlib
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import uvicorn

    server = QuotaServer(window, family)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = uvicorn.Config(server.app(), log_level="warning", lifespan="off")
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(runner.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not runner.started:
        time.sleep(0.01)
    base = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="sk-bench")
    policy = llm_backoff.RetryPolicy(deadline=2 * window)
    client = {
        "plain": base,
        "off": llm_backoff.wrap(base, policy, follow_rate_headers=False),
        "paced": llm_backoff.wrap(base, policy),
    }[arm]
    failed = [0]
    started = time.monotonic()
    end = started + window * windows

    def loop() -> None:
        while time.monotonic() < end:
            try:
                client.chat.completions.create(**QUOTA_ASK)
            except (openai.APIError, llm_backoff.RateLimitTimeout):
                failed[0] += 1

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(loop) for _ in range(8)]:
            future.result()
    elapsed = time.monotonic() - started
    runner.should_exit = True
    thread.join(5)
    with contextlib.suppress(OSError):
        sock.close()
    # The most the server could have taken: a full bucket, then the refill over the run.
    most = 1.0 + elapsed / window
    attempts = server.admitted[0] + server.refused
    return {
        "attempts": attempts,
        "refused": server.refused,
        "refused_share": server.refused / attempts if attempts else 0.0,
        "requests_used": server.admitted[0] / (QUOTA_REQUESTS * most),
        "tokens_used": server.admitted[1] / (QUOTA_TOKENS * most),
        "failed_calls": failed[0],
    }


def quota_report(window: float, windows: int, family: str, arms: list[str]) -> None:
    print(
        f"8 threads, {QUOTA_REQUESTS} requests and {QUOTA_TOKENS} tokens per {window:g} s window, "
        f"{windows} windows, {family} headers"
    )
    print("| arm | attempts | refused | refused share | requests used | tokens used | failed calls |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for arm in arms:
        r = quota_arm(arm, window, windows, family)
        print(
            f"| {arm} | {r['attempts']:.0f} | {r['refused']:.0f} | {r['refused_share'] * 100:.1f} % | "
            f"{r['requests_used']:.3f} | {r['tokens_used']:.3f} | {r['failed_calls']:.0f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("overhead", "opcodes", "quota"), default="overhead")
    parser.add_argument("--window", type=float, default=60.0, help="quota mode: seconds per window")
    parser.add_argument("--windows", type=int, default=3, help="quota mode: windows per arm")
    parser.add_argument("--headers", choices=("openai", "anthropic", "ietf"), default="openai")
    parser.add_argument("--arms", default="plain,off,paced", help="quota mode: comma-separated arms")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=200, help="calls per client per round")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    python = platform.python_version()
    versions = f"openai {openai.__version__} on {http.__name__} {http.__version__}, Python {python}"
    if args.mode == "opcodes":
        print(versions)
        opcodes_report()
        return
    if args.mode == "quota":
        print(versions)
        quota_report(args.window, args.windows, args.headers, args.arms.split(","))
        return
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    calls = args.calls
    print(f"{versions}, {args.rounds} rounds x {calls} calls per client, {args.clock} time", flush=True)
    results: dict[str, dict[str, float]] = {}
    s_bare, s_wrapped = sync_pair()
    results["sync"] = run(
        "sync", partial(time_sync, s_bare, calls), partial(time_sync, s_wrapped, calls), args.rounds, calls
    )
    loop = asyncio.new_event_loop()

    def timed(client: openai.AsyncOpenAI) -> Callable[[], float]:
        return lambda: loop.run_until_complete(time_async(client, calls))

    a_bare, a_wrapped = async_pair()
    try:
        results["async"] = run("async", timed(a_bare), timed(a_wrapped), args.rounds, calls)
    finally:
        loop.close()

    print()
    print(
        "| client | bare us/call (min) | wrapped us/call (min) | overhead us/call | "
        "median ratio wrapped/bare | ratio IQR | median 95 % CI | pooled ratio | ratio of minima |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |")
    for name, r in results.items():
        extra = r["wrapped_us"] - r["bare_us"]
        print(
            f"| {name} | {r['bare_us']:.1f} | {r['wrapped_us']:.1f} | {extra:+.1f} | "
            f"{r['ratio']:.3f} ({(r['ratio'] - 1) * 100:+.1f} %) | {r['q1']:.3f} .. {r['q3']:.3f} | "
            f"{r['ci_low']:.3f} .. {r['ci_high']:.3f} | {r['pooled']:.3f} | {r['ratio_of_min']:.3f} |"
        )


if __name__ == "__main__":
    main()
