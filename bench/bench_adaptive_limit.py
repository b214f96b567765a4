"""Where does the adaptive (gradient) concurrency limit settle, against the simulator's knee?

    .venv/bin/python bench/bench_adaptive_limit.py            # about 50 s
    .venv/bin/python bench/bench_adaptive_limit.py --quick    # about 25 s

The simulator (a subprocess) runs ``--max-num-seqs 8`` sequences at once: that is
its knee. Beyond 8 in flight, requests wait inside the engine and time to first
token jumps from ``--ttft`` to about a whole generation. Three shims (subprocesses)
take turns in front of the same simulator, each under the same closed-loop load of
32 streaming clients (4x the knee):

- ``fixed 8``   ``--max-concurrency 8``, the knee, known in advance;
- ``fixed 32``  ``--max-concurrency 32``: no useful cap, the engine queues;
- ``adaptive``  ``--adaptive-concurrency --min-concurrency 1 --max-concurrency 64``.

For each: completions/s, client-side time to first token (p50/p95) and, for the
adaptive shim, its limit read from ``/metrics`` every 0.25 s (trajectory + where
it settled). Ratios are against ``fixed 8`` in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from llm_backoff_shim.lab.procs import shim_server, sigterm_as_interrupt, sim_server

KNEE = 8
SIM_FLAGS = [
    "--max-num-seqs",
    str(KNEE),
    "--ttft",
    "0.05",
    "--itl",
    "0.01",
    "--output-tokens",
    "30",
    "--seed",
    "1",
]
CLIENTS = 32
BODY = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}


@dataclass
class Phase:
    name: str
    flags: list[str]
    ttft: list[float] = field(default_factory=list)
    completions: int = 0
    errors: int = 0
    limits: list[tuple[float, float]] = field(default_factory=list)
    engine_waiting: list[tuple[float, float]] = field(default_factory=list)
    seconds: float = 0.0


async def _client(
    session: aiohttp.ClientSession, url: str, phase: Phase, start: float, end: float, warm: float
) -> None:
    while time.monotonic() < end:
        sent = time.monotonic()
        try:
            async with session.post(url + "/v1/chat/completions", json=BODY) as response:
                if response.status != 200:
                    await response.read()
                    phase.errors += 1
                    await asyncio.sleep(0.05)
                    continue
                first: float | None = None
                async for _chunk in response.content.iter_any():
                    if first is None:
                        first = time.monotonic() - sent
        except aiohttp.ClientError:
            phase.errors += 1
            continue
        if sent - start >= warm and first is not None:
            phase.ttft.append(first)
            phase.completions += 1


async def _gauge(session: aiohttp.ClientSession, url: str, prefix: str) -> float | None:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return None


async def _watch(
    session: aiohttp.ClientSession, shim: str, sim: str, phase: Phase, start: float, end: float
) -> None:
    """The shim's limit and the engine's own waiting queue, every 0.25 s."""
    while time.monotonic() < end:
        try:
            limit = await _gauge(session, shim, "llm_backoff_shim_concurrency_limit ")
            waiting = await _gauge(session, sim, "vllm:num_requests_waiting")
            now = time.monotonic() - start
            if limit is not None:
                phase.limits.append((now, limit))
            if waiting is not None:
                phase.engine_waiting.append((now, waiting))
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.25)


async def _drive(url: str, sim: str, phase: Phase, duration: float, warm: float) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic()
        end = start + duration
        progress = asyncio.create_task(_progress(phase, start, end))
        await asyncio.gather(
            _watch(session, url, sim, phase, start, end),
            *(_client(session, url, phase, start, end, warm) for _ in range(CLIENTS)),
        )
        progress.cancel()
        phase.seconds = duration - warm


async def _progress(phase: Phase, start: float, end: float) -> None:
    while time.monotonic() < end:
        await asyncio.sleep(2.0)
        limit = f", limit {phase.limits[-1][1]:.0f}" if phase.limits else ""
        print(
            f"  {phase.name:<9} t={time.monotonic() - start:4.0f}s  {phase.completions} done{limit}",
            file=sys.stderr,
            flush=True,
        )


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shorter phases (about 25 s in all)")
    args = parser.parse_args(argv)
    duration, warm = (8.0, 3.0) if args.quick else (16.0, 6.0)
    phases = [
        Phase("fixed 8", ["--max-concurrency", "8"]),
        Phase("fixed 32", ["--max-concurrency", "32"]),
        Phase("adaptive", ["--adaptive-concurrency", "--min-concurrency", "1", "--max-concurrency", "64"]),
    ]
    common = ["--max-queue", "64", "--max-queue-wait", "60"]
    print(
        f"simulator: {' '.join(SIM_FLAGS)} (knee = {KNEE} sequences); {CLIENTS} streaming clients",
        file=sys.stderr,
    )
    with sigterm_as_interrupt(), sim_server(SIM_FLAGS) as sim:
        for phase in phases:
            with shim_server(sim, [*common, *phase.flags]) as shim:
                print(f"{phase.name}: {duration:.0f} s ({warm:.0f} s warm-up not counted)", file=sys.stderr)
                asyncio.run(_drive(shim.url, sim.url, phase, duration, warm))
    base = phases[0]
    base_rate = base.completions / base.seconds
    base_p50 = _pct(base.ttft, 0.5)
    print()
    print(
        "| shim | completions/s | vs fixed 8 | TTFT p50 (s) | TTFT p95 (s) | p50 vs fixed 8 "
        "| waiting in the engine (mean) | errors |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for phase in phases:
        rate = phase.completions / phase.seconds
        p50, p95 = _pct(phase.ttft, 0.5), _pct(phase.ttft, 0.95)
        waiting = [w for t, w in phase.engine_waiting if t >= warm]
        engine = f"{statistics.fmean(waiting):.1f}" if waiting else "-"
        print(
            f"| {phase.name} | {rate:.1f} | {rate / base_rate:.2f}x | {p50:.3f} | {p95:.3f} | "
            f"{p50 / base_p50:.2f}x | {engine} | {phase.errors} |"
        )
    adaptive = phases[-1]
    settled = [limit for t, limit in adaptive.limits if t >= warm]
    if settled:
        print()
        print(
            f"adaptive limit after warm-up: mean {statistics.fmean(settled):.1f}, median "
            f"{statistics.median(settled):.0f}, min {min(settled):.0f}, max {max(settled):.0f} "
            f"(knee {KNEE}; {len(settled)} readings)"
        )
        trajectory = " ".join(
            f"{limit:.0f}" for _, limit in adaptive.limits[:: max(1, len(adaptive.limits) // 24)]
        )
        print(f"trajectory (every ~{duration / 24:.1f} s): {trajectory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
