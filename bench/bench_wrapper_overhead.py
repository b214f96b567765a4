"""Overhead of llm_backoff.wrap() on successful calls, against a bare openai client.

Both clients talk to the same in-process mock transport (no sockets), so what is
measured is the client-side cost per call: openai's request building and response
parsing, plus, for the wrapped client, the retry transport (body replay, deadline
stamping, JSON buffering, attempt record) and the error-annotation hook.

Rounds interleave bare and wrapped (order alternating) so machine noise hits both
alike; each round runs ``--calls`` consecutive calls per client, as an application
uses one client at a time. Reported are the median over rounds of wrapped/bare time with its
interquartile range (the spread of single rounds) and its 95 % confidence interval
(order statistics: how well the median itself is known), the pooled ratio (all
wrapped time over all bare time), and the ratio of the fastest rounds, which is
the least disturbed by other processes (as timeit reports minima). Time is
this process's CPU time by default (``--clock cpu``): on a shared machine, wall
time also counts the moments other processes held the CPU, which swamps a few
percent; ``--clock wall`` is there for quiet machines.

``--mode opcodes`` counts instead of timing: the Python bytecode instructions executed
per call (``sys.settrace`` with opcode events), bare and wrapped, sync and async. It
does not see work done in C (JSON parsing, pydantic-core) and does not weigh one
instruction against another, but it is exact and the same on a loaded machine, so
it tells whether a change removed work; the CPU-time ratio says what the work costs.

    .venv/bin/python bench/bench_wrapper_overhead.py [--rounds 41] [--calls 200] [--clock cpu|wall]
    .venv/bin/python bench/bench_wrapper_overhead.py --mode opcodes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import openai

import llm_backoff

OPENAI3 = openai.__version__.startswith("3.")
if OPENAI3:
    import httpx2 as http
else:  # pragma: no cover - openai 2.x environment
    import httpx as http  # type: ignore[no-redef]

COMPLETION = json.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hello"}}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()
MESSAGES: Any = [{"role": "user", "content": "Say hello in one word."}]


def handler(request: Any) -> Any:
    return http.Response(200, headers={"content-type": "application/json"}, content=COMPLETION)


def sync_pair() -> tuple[openai.OpenAI, openai.OpenAI]:
    bare = openai.OpenAI(
        api_key="sk-bench",
        base_url="http://bench/v1",
        max_retries=0,
        http_client=http.Client(transport=http.MockTransport(handler)),
    )
    return bare, llm_backoff.wrap(bare)


def async_pair() -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    bare = openai.AsyncOpenAI(
        api_key="sk-bench",
        base_url="http://bench/v1",
        max_retries=0,
        http_client=http.AsyncClient(transport=http.MockTransport(handler)),
    )
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
        print(
            f"  {name} round {r + 1:>2}/{rounds}: bare {b / calls * 1e6:7.1f} us/call, "
            f"wrapped {w / calls * 1e6:7.1f} us/call, ratio {w / b:.3f}",
            file=sys.stderr,
            flush=True,
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
            bare = count_opcodes(bare_call)
            wrapped = count_opcodes(wrapped_call)
            print(
                f"| {name} | {bare:.0f} | {wrapped:.0f} | {wrapped - bare:+.0f} | "
                f"{(wrapped / bare - 1) * 100:+.2f} % |"
            )
    finally:
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("overhead", "opcodes"), default="overhead")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=200, help="calls per client per round")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    if args.mode == "opcodes":
        versions = f"openai {openai.__version__} on {http.__name__} {http.__version__}"
        print(f"{versions}, Python {platform.python_version()}")
        opcodes_report()
        return
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    print(
        f"openai {openai.__version__} on {http.__name__} {http.__version__}, "
        f"Python {platform.python_version()}, {args.rounds} rounds x {args.calls} calls per client, "
        f"{args.clock} time",
        flush=True,
    )
    results: dict[str, dict[str, float]] = {}

    s_bare, s_wrapped = sync_pair()
    results["sync"] = run(
        "sync",
        lambda: time_sync(s_bare, args.calls),
        lambda: time_sync(s_wrapped, args.calls),
        args.rounds,
        args.calls,
    )

    a_bare, a_wrapped = async_pair()
    loop = asyncio.new_event_loop()
    try:
        results["async"] = run(
            "async",
            lambda: loop.run_until_complete(time_async(a_bare, args.calls)),
            lambda: loop.run_until_complete(time_async(a_wrapped, args.calls)),
            args.rounds,
            args.calls,
        )
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
