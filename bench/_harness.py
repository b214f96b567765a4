"""The loopback harness of the benchmarks: pinned child processes, a fast fake engine, load, references.

Bench-only. Run as a process, it plays one role::

    python bench/_harness.py upstream --port 8001          # the fast fake engine
    python bench/_harness.py relay --port 8002 --upstream http://127.0.0.1:8001
    python bench/_harness.py loadgen sse --target 127.0.0.1:8080 --streams 64 --chunks 400 --rate 200
    python bench/_harness.py loadgen http --target 127.0.0.1:8080 --conns 16

- **upstream**: a fixed ~300-byte chat completion at once, or with ``x-bench-chunks: N`` an SSE
  stream of N events plus ``[DONE]`` at ``x-bench-rate`` events/s (absolute schedule);
- **loadgen** ``sse`` (streams checked complete, next request on the same connection) or ``http``
  (closed-loop POSTs, latency write to last byte); prints ``{"mark": "start"}`` after the warm-up
  and a JSON result at the window's end, so the caller reads the proxy's CPU at those moments;
- **relay**: the minimal uvicorn + aiohttp streaming relay, the reference a proxy is set against.

Upstream and loadgen share a core, hence raw asyncio protocols and httptools, not ASGI. Loopback-only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httptools
import uvloop

from llm_backoff_shim.lab.procs import ChildServer

# -- child processes ----------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")
NGINX = "/usr/sbin/nginx"


def pin_prefix(cpu: int | None) -> list[str]:
    """``taskset -c CPU`` when pinning is possible, else nothing (the run says so)."""
    if cpu is None or shutil.which("taskset") is None or cpu not in os.sched_getaffinity(0):
        return []
    return ["taskset", "-c", str(cpu)]


def boost(pid: int, nice: int) -> bool:
    """Give ``pid``'s scheduling group ``nice``; False when not permitted. Under autogroup scheduling a
    nice value only ranks processes within a session, so each child has its own session and the
    value goes on that session's autogroup."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, nice)
            return True
        return False
    return True


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its live descendants, in seconds."""
    total = 0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces; fields after it are fixed.
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        stack += _children(current)
    return total / _TICKS


class Child(ChildServer):
    """A server on 127.0.0.1 (:class:`~llm_backoff_shim.lab.procs.ChildServer`: a fresh port,
    waited for on ``/health``, stopped with SIGTERM then SIGKILL), pinned to ``cpu``, in a
    session of its own whose autogroup gets ``nice`` when allowed; its CPU time readable."""

    def __init__(
        self, name: str, argv: Callable[[int], Sequence[str]], *, cpu: int | None, nice: int | None = None
    ) -> None:
        super().__init__(name, lambda port: [*pin_prefix(cpu), *argv(port)], new_session=True)
        self.nice = nice
        self.boosted = False

    def launch(self) -> Child:
        super().launch()
        self.boosted = self.nice is not None and self.pid is not None and boost(self.pid, self.nice)
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def cpu(self) -> float:
        return cpu_seconds(self.pid or 0)


def nginx_config(workdir: Path, listen_port: int, upstream: str) -> Path:
    """A reverse-proxy config: one worker, upstream keep-alive, no response buffering."""
    temp_paths = ""
    for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (workdir / name).mkdir(exist_ok=True)
        temp_paths += f"\n    {name}_temp_path {workdir / name};"
    # As root the worker would switch to "nobody", which cannot use our private temp dirs.
    user = f"user {getpass.getuser()};\n" if os.geteuid() == 0 else ""
    text = f"""{user}daemon off;
master_process on;
worker_processes 1;
pid {workdir / "nginx.pid"};
error_log {workdir / "error.log"} warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;{temp_paths}
    keepalive_requests 1000000;
    upstream engine {{
        server {upstream};
        keepalive 256;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{listen_port} backlog=4096;
        location = /health {{ return 200 "ok"; }}
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""
    path = workdir / "nginx.conf"
    path.write_text(text)
    return path


def nginx_argv(config: Path) -> list[str]:
    return [NGINX, "-p", str(config.parent), "-c", str(config), "-e", str(config.parent / "error.log")]


# -- upstream: the fast fake engine -------------------------------------------------------------

_JSON_BODY = (
    b'{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"' + b"ok " * 40 + b'"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":8,"completion_tokens":40,"total_tokens":48}}'
)

_JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_JSON_BODY)).encode()
    + b"\r\n\r\n"
    + _JSON_BODY
)
_HEALTH_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


_EVENT = _chunk(
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
)
_DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class _Stream:
    """One paced SSE response; each event is written by its own timer callback."""

    def __init__(self, conn: _Connection, chunks: int, rate: float) -> None:
        self.conn, self.left, self.sent = conn, chunks, 0
        self.gap = 1.0 / rate if rate > 0 else 0.0
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        conn.transport.write(_SSE_HEAD)
        self._next()

    def _next(self) -> None:
        if self.conn.closed:
            return
        if self.left == 0:
            self.conn.transport.write(_DONE)
            self.conn.stream = None
            self.conn.resume()
            return
        self.sent += 1
        self.loop.call_at(self.start + self.sent * self.gap, self._emit)

    def _emit(self) -> None:
        if self.conn.closed:
            return
        self.conn.transport.write(_EVENT)
        self.left -= 1
        self._next()


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport
        self.closed = False
        self.stream: _Stream | None = None
        self.url, self.chunks, self.rate = b"", 0, 0.0
        self.pending: list[bytes] = []

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        if self.stream is not None:
            self.pending.append(data)  # a request sent before the stream ended: parse it afterwards
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def resume(self) -> None:
        pending, self.pending = self.pending, []
        for data in pending:
            self.data_received(data)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.chunks, self.rate = b"", 0, 0.0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"x-bench-chunks":
            self.chunks = int(value)
        elif lowered == b"x-bench-rate":
            self.rate = float(value)

    def on_message_complete(self) -> None:
        if self.url == b"/health":
            self.transport.write(_HEALTH_RESPONSE)
        elif self.chunks > 0:
            self.stream = _Stream(self, self.chunks, self.rate)
        else:
            self.transport.write(_JSON_RESPONSE)


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Connection, host, port, backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


# -- loadgen ------------------------------------------------------------------------------------

_PATH = b"/v1/chat/completions"


def build_request(host: str, *, stream: bool, chunks: int = 0, rate: float = 0.0) -> bytes:
    fields = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
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
        self.tally, self.expected_events = tally, expected_events
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[bool] | None = None
        self.sent_ns, self.events, self.last_newline, self.status, self.closed = 0, 0, False, 0, False

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


async def loadgen(args: argparse.Namespace) -> dict[str, object]:
    host, _, port_text = args.target.partition(":")
    port = int(port_text)
    if args.mode == "sse":
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


# -- relay: the reference ------------------------------------------------------------

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade", b"proxy-connection"}


def relay_app(upstream: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The minimal streaming proxy on aiohttp, with LLM-fit settings (no pool cap, no read timeout)."""
    import aiohttp

    state: dict[str, aiohttp.ClientSession] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["client"] = aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=600),
                        auto_decompress=False,
                        skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
                        cookie_jar=aiohttp.DummyCookieJar(),
                    )
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await state["client"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        chunks, more = [], True
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
        async with state["client"].request(
            scope["method"], url, headers=headers, data=body or None
        ) as response:
            out = [(k.lower(), v) for k, v in response.raw_headers if k.lower() not in HOP]
            await send({"type": "http.response.start", "status": response.status, "headers": out})
            async for piece in response.content.iter_any():
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    roles = parser.add_subparsers(dest="role", required=True)
    for role in ("upstream", "relay"):
        sub = roles.add_parser(role)
        sub.add_argument("--port", type=int, required=True)
        sub.add_argument("--upstream", default="", help="relay: the upstream's URL")
    load = roles.add_parser("loadgen")
    load.add_argument("mode", choices=("sse", "http"))
    load.add_argument("--target", required=True, help="host:port")
    load.add_argument("--streams", type=int, default=64)
    load.add_argument("--chunks", type=int, default=400)
    load.add_argument("--rate", type=float, default=200.0, help="events per second per stream")
    load.add_argument("--conns", type=int, default=1)
    load.add_argument("--warmup", type=float, default=1.0)
    load.add_argument("--window", type=float, default=5.0)
    args = parser.parse_args()
    if args.role == "loadgen":
        print(json.dumps(uvloop.run(loadgen(args))), flush=True)
    elif args.role == "upstream":
        uvloop.run(serve("127.0.0.1", args.port))
    else:
        import uvicorn

        uvicorn.run(
            relay_app(args.upstream),
            host="127.0.0.1",
            port=args.port,
            loop="uvloop",
            http="httptools",
            log_level="warning",
            access_log=False,
            server_header=False,
            date_header=False,
            lifespan="on",
            backlog=4096,
        )


if __name__ == "__main__":
    main()
