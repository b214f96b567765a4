"""Load generator for the proxy benchmark, run as its own process (pinned by the caller).

    python bench/_loadgen.py sse  --target 127.0.0.1:8080 --streams 64 --chunks 400 --rate 200 \
                                  --warmup 1 --window 5
    python bench/_loadgen.py http --target 127.0.0.1:8080 --conns 16 --warmup 1 --window 5
    python bench/_loadgen.py sse  --target 127.0.0.1:8000 --streams 128 --max-tokens 200   # an engine

``sse``: every connection asks for a stream of ``--chunks`` SSE events at ``--rate``
events/s, counts the events as they arrive, checks each stream is complete
(every event plus ``[DONE]``), then asks for the next stream on the same keep-alive
connection. ``http``: closed-loop POSTs of a small chat completion, one in flight per
connection, latency from write to last byte. Both print a ``{"mark": "start"}`` line
when the warm-up ends and a JSON result line when the measuring window ends, so the
caller can read the proxy's CPU counters at the same two moments.

Hand-written on asyncio protocols and httptools rather than aiohttp because it shares
a core with the fake engine; per event it only scans the bytes it received (the
``wrk`` binary, when installed, takes the ``http`` role for the latency figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import cast

import httptools
import uvloop

_PATH = b"/v1/chat/completions"


def build_request(
    host: str, *, stream: bool, chunks: int = 0, rate: float = 0.0, max_tokens: int | None = None
) -> bytes:
    fields: dict[str, object] = {
        "model": "bench",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }
    if max_tokens is not None:  # an engine (the simulator): the answer's length, exactly
        fields.update(max_tokens=max_tokens, ignore_eos=True)
    body = json.dumps(fields, separators=(",", ":")).encode()
    lines = [
        b"POST " + _PATH + b" HTTP/1.1",
        b"host: " + host.encode(),
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
    ]
    if stream:
        lines += [b"x-bench-chunks: " + str(chunks).encode(), b"x-bench-rate: " + str(rate).encode()]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@dataclass
class Tally:
    """Counters shared by all connections; ``counting`` is off during warm-up."""

    counting: bool = False
    events: int = 0
    reads: int = 0
    completed: int = 0
    errors: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class _Client(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight."""

    def __init__(self, tally: Tally, expected_events: int) -> None:
        self.tally = tally
        self.expected_events = expected_events
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[bool] | None = None
        self.sent_ns = 0
        self.events = 0
        self.last_newline = False
        self.status = 0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            self.done.set_result(False)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def send(self, request: bytes) -> asyncio.Future[bool]:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.events, self.last_newline, self.status = 0, False, 0
        self.sent_ns = time.perf_counter_ns()
        self.transport.write(request)
        return self.done

    # -- httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        # Events end in a blank line; one may straddle two reads.
        count = body.count(b"\n\n")
        if self.last_newline and body[:1] == b"\n":
            count += 1
        self.last_newline = body[-1:] == b"\n" and body[-2:] != b"\n\n"
        self.events += count
        if self.tally.counting:
            self.tally.events += count
            self.tally.reads += 1

    def on_message_complete(self) -> None:
        elapsed = time.perf_counter_ns() - self.sent_ns
        tally = self.tally
        ok = self.status == 200 and (self.expected_events == 0 or self.events == self.expected_events)
        if tally.counting:
            if not ok:
                tally.error(f"status {self.status}" if self.status != 200 else "incomplete stream")
            else:
                tally.completed += 1
                if self.expected_events == 0:
                    tally.latencies_ns.append(elapsed)
        if self.done is not None and not self.done.done():
            self.done.set_result(self.parser.should_keep_alive())


async def _connection_loop(
    host: str, port: int, request: bytes, tally: Tally, expected_events: int, stop: asyncio.Event
) -> None:
    loop = asyncio.get_running_loop()
    client: _Client | None = None
    while not stop.is_set():
        if client is None or client.closed:
            try:
                _, client = await loop.create_connection(lambda: _Client(tally, expected_events), host, port)
            except OSError:
                if tally.counting:
                    tally.error("connect")
                await asyncio.sleep(0.05)
                continue
        keep_alive = await client.send(request)
        if not keep_alive and client.transport is not None:
            client.transport.close()
            client = None
    if client is not None and client.transport is not None:
        client.transport.close()


def _percentile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values)) - 1))
    return sorted_values[index] / 1e6


async def run(args: argparse.Namespace) -> dict[str, object]:
    host, _, port_text = args.target.partition(":")
    port = int(port_text)
    if args.mode == "sse" and args.max_tokens is not None:
        request = build_request(args.target, stream=True, max_tokens=args.max_tokens)
        conns, expected = args.streams, 0
    elif args.mode == "sse":
        request = build_request(args.target, stream=True, chunks=args.chunks, rate=args.rate)
        conns, expected = args.streams, args.chunks + 1
    else:
        request = build_request(args.target, stream=False)
        conns, expected = args.conns, 0
    tally = Tally()
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(_connection_loop(host, port, request, tally, expected, stop))
        for _ in range(conns)
    ]
    await asyncio.sleep(args.warmup)
    tally.counting = True
    started = time.perf_counter()
    cpu_started = time.process_time()
    print(json.dumps({"mark": "start"}), flush=True)
    await asyncio.sleep(args.window)
    tally.counting = False
    elapsed = time.perf_counter() - started
    result: dict[str, object] = {
        "mark": "end",
        "elapsed": elapsed,
        "cpu_s": time.process_time() - cpu_started,
        "completed": tally.completed,
        "errors": tally.errors,
        "error_kinds": tally.error_kinds,
    }
    if args.mode == "sse":
        result.update(events=tally.events, reads=tally.reads)
    else:
        latencies = sorted(tally.latencies_ns)
        result.update(p50_ms=_percentile(latencies, 50), p99_ms=_percentile(latencies, 99))
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="proxy benchmark load generator")
    parser.add_argument("mode", choices=("sse", "http"))
    parser.add_argument("--target", required=True, help="host:port")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=400)
    parser.add_argument("--rate", type=float, default=200.0, help="events per second per stream")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="sse against an engine: ask for this many tokens (ignore_eos) instead of x-bench-chunks",
    )
    parser.add_argument("--conns", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--window", type=float, default=5.0)
    args = parser.parse_args()
    result = uvloop.run(run(args))
    print(json.dumps(result), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
