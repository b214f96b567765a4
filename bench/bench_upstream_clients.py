"""Which HTTP client should the shim use upstream? httpx vs httpx2 vs aiohttp vs our own, side by side.

    .venv/bin/python bench/bench_upstream_clients.py            # full run, ~1-2 minutes
    .venv/bin/python bench/bench_upstream_clients.py --quick    # smaller counts, ~30 s

Each variant is a minimal streaming relay (raw ASGI on uvicorn + uvloop + httptools,
one process pinned to one core) in front of the same fast upstream: on httpx, httpx2,
aiohttp, and "lean", the shim's own relay client (``llm_backoff_shim.http.upstream_http``,
written when this benchmark showed what aiohttp's generality costs per request). The
real shim (admission, metrics, the lean client) runs as a fifth variant. A load generator (aiohttp, in
this process) measures, in the same run:

1. non-streaming requests/s at 8 and 64 concurrent clients;
2. CPU of the relay process per relayed SSE event (64 concurrent streams, the upstream
   spacing events 2 ms apart like an engine's inter-token latency, so they arrive one
   by one rather than coalesced);
3. the shim's rejection latency when it is full (one slot held, queue 0).

Every phase is bounded in request count and in time; everything runs on 127.0.0.1.
Results are ratios against the aiohttp relay, printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# "lean": the shim's own relay client (llm_backoff_shim.http.upstream_http), written after this
# benchmark showed where aiohttp's CPU goes; the others are the general-purpose clients.
RELAYS = ("httpx", "httpx2", "aiohttp", "lean")
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade", b"proxy-connection"}
PHASE_TIME_CAP = 60.0


# ---------------------------------------------------------------------------------------
# roles run in subprocesses
# ---------------------------------------------------------------------------------------
def upstream_app() -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """A fast fake engine: small JSON, or ``x-chunks`` SSE events ``x-gap`` seconds apart."""
    body = json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 40}}],
        }
    ).encode()
    event = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"delta":{"content":"tok "}}]}\n\n'

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        headers = dict(scope["headers"])
        if hold := headers.get(b"x-hold"):
            await asyncio.sleep(float(hold))
        chunks = int(headers.get(b"x-chunks", b"0"))
        if not chunks:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        gap = float(headers.get(b"x-gap", b"0"))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for _ in range(chunks):
            if gap:
                await asyncio.sleep(gap)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


def relay_app(kind: str, upstream: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The minimal streaming proxy, with each client's LLM-fit settings (no pool cap, no read timeout)."""
    state: dict[str, Any] = {}

    async def open_client() -> None:
        if kind == "lean":
            from llm_backoff_shim.http.upstream_http import UpstreamPool

            state["client"] = UpstreamPool(upstream, read_timeout=600.0, keepalive=4.0)
        elif kind == "aiohttp":
            import aiohttp

            state["client"] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=600),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        else:
            module = __import__(kind)
            state["client"] = module.AsyncClient(
                limits=module.Limits(
                    max_connections=None, max_keepalive_connections=None, keepalive_expiry=4.0
                ),
                timeout=module.Timeout(connect=5.0, read=600.0, write=600.0, pool=None),
                trust_env=False,
            )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await open_client()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    client = state["client"]
                    await (client.close() if kind in ("aiohttp", "lean") else client.aclose())
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/_cpu":
            payload = str(time.process_time()).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": payload})
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k not in HOP and k not in (b"host", b"content-length")
        ]
        url = upstream + scope["path"]
        client = state["client"]
        if kind == "lean":
            skip = (b"host", b"content-length")
            raw = [(k, v) for k, v in scope["headers"] if k not in HOP and k not in skip]
            reply = await client.request(scope["method"], scope["path"].encode(), raw, body)
            try:
                out = [(k.lower(), v) for k, v in reply.headers if k.lower() not in HOP]
                await send({"type": "http.response.start", "status": reply.status, "headers": out})
                while piece := await reply.read_chunk():
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
            finally:
                reply.release()
        elif kind == "aiohttp":
            async with client.request(scope["method"], url, headers=headers, data=body or None) as response:
                out = [(k.lower(), v) for k, v in response.raw_headers if k.lower() not in HOP]
                await send({"type": "http.response.start", "status": response.status, "headers": out})
                async for piece in response.content.iter_any():
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
        else:
            request = client.build_request(scope["method"], url, headers=headers, content=body)
            response = await client.send(request, stream=True)
            try:
                out = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in HOP]
                await send({"type": "http.response.start", "status": response.status_code, "headers": out})
                async for piece in response.aiter_raw():
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
            finally:
                await response.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def run_role(args: argparse.Namespace) -> int:
    import uvicorn

    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {args.cpu})
    app = upstream_app() if args.role == "upstream" else relay_app(args.role, args.upstream)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
        lifespan="on" if args.role != "upstream" else "off",
        backlog=4096,
    )
    return 0


# ---------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def process(argv: list[str], port: int, cpu: int | None = None) -> Iterator[subprocess.Popen[bytes]]:
    env = dict(os.environ)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        if cpu is not None and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(proc.pid, {cpu})
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"{argv} exited: {proc.stderr.read().decode() if proc.stderr else ''}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{argv} did not listen on {port}")
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Load:
    done: int
    seconds: float
    errors: int
    events: int
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0


async def drive(
    url: str, *, total: int, concurrency: int, headers: dict[str, str], count_events: bool = False
) -> Load:
    import aiohttp

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
    headers = {"content-type": "application/json", **headers}
    remaining = total
    done = errors = events = 0
    latencies: list[float] = []
    stop_at = time.monotonic() + PHASE_TIME_CAP

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, done, errors, events
        while remaining > 0 and time.monotonic() < stop_at:
            remaining -= 1
            start = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    if count_events:
                        async for line in response.content:
                            if line.startswith(b"data: {"):
                                events += 1
                    else:
                        await response.read()
                    if response.status >= 300 and response.status not in (429, 503):
                        errors += 1
                        if errors == 1:
                            print(f"    first error: {response.status} {(await response.read())[:200]!r}")
            except aiohttp.ClientError:
                errors += 1
            latencies.append(time.perf_counter() - start)
            done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=PHASE_TIME_CAP)
    ) as session:
        start = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        seconds = time.monotonic() - start
    return Load(done, seconds, errors, events, latencies)


def relay_argv(kind: str, port: int, upstream: str) -> list[str]:
    if kind == "shim":
        return [
            sys.executable, "-m", "llm_backoff_shim.cli", "serve",
            "--port", str(port), "--upstream", upstream, "--max-concurrency", "10000",
            "--max-queue", "10000", "--log-level", "warning",
        ]  # fmt: skip
    return [sys.executable, __file__, "--role", kind, "--port", str(port), "--upstream", upstream]


def measure_variant(kind: str, upstream: str, opts: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    result: dict[str, float] = {}
    with process(relay_argv(kind, port, upstream), port, cpu=1) as proc:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(drive(url, total=200, concurrency=16, headers={}))  # warm-up: pool, caches
        for concurrency in opts.concurrency:
            before = cpu_seconds(proc.pid)
            load = asyncio.run(drive(url, total=opts.requests, concurrency=concurrency, headers={}))
            result[f"cpu_us@{concurrency}"] = (cpu_seconds(proc.pid) - before) / max(1, load.done) * 1e6
            result[f"rps@{concurrency}"] = load.rate
            result["errors"] = result.get("errors", 0) + load.errors
            print(
                f"  {kind:8} json  c={concurrency:<3} {load.rate:8.0f} req/s "
                f"({load.done} in {load.seconds:.1f} s), "
                f"relay CPU {result[f'cpu_us@{concurrency}']:.0f} us/req"
            )
        before = cpu_seconds(proc.pid)
        sse_headers = {"x-chunks": str(opts.chunks), "x-gap": "0.002"}
        load = asyncio.run(
            drive(url, total=opts.streams, concurrency=64, headers=sse_headers, count_events=True)
        )
        used = cpu_seconds(proc.pid) - before
        result["us_per_event"] = used / max(1, load.events) * 1e6
        result["errors"] = result.get("errors", 0) + load.errors
        print(
            f"  {kind:8} sse   {load.events} events, relay CPU {used:.2f} s = "
            f"{result['us_per_event']:.1f} us/event"
        )
    return result


def measure_rejections(upstream: str, count: int) -> dict[str, float]:
    port = free_port()
    argv = [
        sys.executable, "-m", "llm_backoff_shim.cli", "serve", "--port", str(port), "--upstream", upstream,
        "--max-concurrency", "1", "--max-queue", "0", "--log-level", "warning",
    ]  # fmt: skip
    with process(argv, port, cpu=1):
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        async def run() -> Load:
            holder = asyncio.create_task(drive(url, total=1, concurrency=1, headers={"x-hold": "8"}))
            await asyncio.sleep(0.5)
            load = await drive(url, total=count, concurrency=1, headers={})
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holder
            return load

        load = asyncio.run(run())
    lat = sorted(load.latencies)
    return {
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3,
        "max_ms": lat[-1] * 1e3,
        "count": float(len(lat)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--role", choices=["upstream", *RELAYS], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smaller counts (a smoke run)")
    parser.add_argument("--variants", default="httpx,httpx2,aiohttp,lean,shim", help="comma-separated")
    args = parser.parse_args()
    if args.role:
        return run_role(args)
    args.requests = 600 if args.quick else 3000
    args.streams = 64 if args.quick else 256
    args.chunks = 20 if args.quick else 40
    args.concurrency = [8, 64]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    print(
        f"cores: {os.cpu_count()}; relay pinned to cpu 1, upstream to cpu 0; python {sys.version.split()[0]}"
    )
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    results: dict[str, dict[str, float]] = {}
    with process([sys.executable, __file__, "--role", "upstream", "--port", str(up_port)], up_port, cpu=0):
        for kind in variants:
            print(f"== {kind}")
            results[kind] = measure_variant(kind, upstream, args)
        rejections = measure_rejections(upstream, 200 if args.quick else 1000) if "shim" in variants else None
    base = results.get("aiohttp")
    print()
    print(
        "| relay | req/s @8 | req/s @64 | CPU µs/request @64 | CPU µs per SSE event | errors "
        "| req/s @64 vs aiohttp | µs/request vs aiohttp | µs/event vs aiohttp |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind, r in results.items():
        ratio_rps = f"{r['rps@64'] / base['rps@64']:.2f}x" if base else "-"
        ratio_cpu = f"{r['us_per_event'] / base['us_per_event']:.2f}x" if base else "-"
        ratio_req = f"{r['cpu_us@64'] / base['cpu_us@64']:.2f}x" if base else "-"
        print(
            f"| {kind} | {r['rps@8']:.0f} | {r['rps@64']:.0f} | {r['cpu_us@64']:.0f} "
            f"| {r['us_per_event']:.1f} | {r['errors']:.0f} | {ratio_rps} | {ratio_req} | {ratio_cpu} |"
        )
    if rejections:
        print()
        print(
            f"shim rejection latency (full: 1 slot held, queue 0), "
            f"{rejections['count']:.0f} sequential 429s, "
            f"client-measured: p50 {rejections['p50_ms']:.2f} ms, p99 {rejections['p99_ms']:.2f} ms, "
            f"max {rejections['max_ms']:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
