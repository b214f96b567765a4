"""What a refusal costs the shim: answered from the request's head, or after its body.

    .venv/bin/python bench/bench_refusals.py            # ~1 min: 3 interleaved rounds
    .venv/bin/python bench/bench_refusals.py --quick    # one round of 1 s windows

Two shims side by side, identical but for ``--refuse-from-head``, each with one slot held
by a request its upstream never answers and no queue, so every other generation request
is refused (429 ``queue_full``). ``wrk`` (closed loop, ``--conns`` keep-alive
connections) sends chat requests with a small body and with a ~16 KB one (a long
prompt), each shim in turn, rounds interleaved. Per cell: refusals/s, the shim's CPU
per refusal (its user + system time over the window, over the refusals its own metrics
counted), and wrk's p50/p99 time to the answer. The shims run on one CPU, wrk on the
other (when there are two). Compare the ratios; the absolute figures move with the
machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

import _procs
from llm_backoff_shim.lab.procs import free_port

SHIM_CPU, LOAD_CPU = (1, 0) if (os.cpu_count() or 1) >= 2 else (None, None)
MODES = ("head", "body")
SIZES = {"small": 40, "16KB": 16_000}


def _body(size: int) -> str:
    content = ("lorem ipsum " * (size // 12 + 1))[:size]
    return json.dumps({"model": "bench", "messages": [{"role": "user", "content": content}]})


def _wrk_script(body: str) -> str:
    return (
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(body)}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        "done = function(summary, latency, requests)\n"
        '  io.write(string.format(\'{"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d}\\n\',\n'
        "    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99)))\n"
        "end\n"
    )


class HoldingUpstream:
    """An upstream that reads requests and never answers: whatever reaches it holds its slot."""

    def __init__(self) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _serve(self) -> asyncio.AbstractServer:
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await reader.read(65536):
                pass
            writer.close()

        return await asyncio.start_server(hold, "127.0.0.1", self.port)

    def __enter__(self) -> HoldingUpstream:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


class HeldShim:
    """A shim child with its one slot taken by a request the upstream never answers."""

    def __init__(self, mode: str, upstream: HoldingUpstream) -> None:
        self.mode = mode
        port = free_port()
        argv = [
            sys.executable, "-m", "llm_backoff_shim.cli", "serve",
            "--upstream", f"http://127.0.0.1:{upstream.port}", "--port", str(port),
            "--max-concurrency", "1", "--max-queue", "0", "--log-level", "warning",
            "--refuse-from-head", "true" if mode == "head" else "false",
        ]  # fmt: skip
        self.child = _procs.Child(f"shim ({mode})", argv, port, cpu=SHIM_CPU)
        self._holder: socket.socket | None = None

    def __enter__(self) -> HeldShim:
        self.child.start()
        body = _body(SIZES["small"]).encode()
        self._holder = socket.create_connection(("127.0.0.1", self.child.port), timeout=10)
        self._holder.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: shim\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        deadline = time.monotonic() + 10
        while self.counts().get("admitted", 0) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the shim ({self.mode}) never admitted the holding request")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._holder is not None:
            self._holder.close()
        self.child.stop()

    def counts(self) -> dict[str, float]:
        """The shim's requests_total by outcome (rejections by code), from its /metrics."""
        text = httpx.get(f"http://{self.child.address}/metrics", timeout=5).text
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "llm_backoff_shim_requests_total":
                    labels = sample.labels
                    key = (
                        labels["outcome"] if labels["outcome"] != "rejected" else f"rejected {labels['code']}"
                    )
                    counts[key] = counts.get(key, 0.0) + sample.value
        return counts


@dataclass
class Cell:
    mode: str
    size: str
    refusals: int
    other: int
    seconds: float
    cpu_s: float
    p50_ms: float
    p99_ms: float

    @property
    def rate(self) -> float:
        return self.refusals / self.seconds

    @property
    def cpu_us(self) -> float:
        return self.cpu_s / self.refusals * 1e6 if self.refusals else float("nan")


def measure(shim: HeldShim, size: str, script: Path, conns: int, seconds: float) -> Cell:
    before, cpu_before = shim.counts(), shim.child.cpu()
    argv = [*_procs.pin_prefix(LOAD_CPU), "wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "-s", str(script)]
    out = subprocess.run(
        [*argv, f"http://{shim.child.address}/v1/chat/completions"],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
        check=True,
    ).stdout
    cpu_after, after = shim.child.cpu(), shim.counts()
    data = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    refusals = int(delta.pop("rejected queue_full", 0))
    return Cell(
        shim.mode,
        size,
        refusals,
        int(sum(delta.values())),
        data["duration_us"] / 1e6,
        cpu_after - cpu_before,
        data["p50_us"] / 1e3,
        data["p99_us"] / 1e3,
    )


def report(cells: list[Cell]) -> str:
    lines = [
        f"{'body':>6}  {'refused from':>12}  {'refusals/s':>10}  {'shim CPU/refusal':>16}  "
        f"{'p50':>8}  {'p99':>8}  {'not 429':>7}"
    ]
    for size in SIZES:
        per_mode: dict[str, list[Cell]] = {
            m: [c for c in cells if c.size == size and c.mode == m] for m in MODES
        }
        for mode, runs in per_mode.items():
            lines.append(
                f"{size:>6}  {mode:>12}  {statistics.median(c.rate for c in runs):>10.0f}  "
                f"{statistics.median(c.cpu_us for c in runs):>13.0f} us  "
                f"{statistics.median(c.p50_ms for c in runs):>6.2f}ms  "
                f"{statistics.median(c.p99_ms for c in runs):>6.2f}ms  {sum(c.other for c in runs):>7}"
            )
        ratios = [b.cpu_us / h.cpu_us for h, b in zip(per_mode["head"], per_mode["body"], strict=True)]
        shown = ", ".join(f"{r:.2f}" for r in ratios)
        lines.append(
            f"{'':>6}  CPU per refusal, after the body / from the head: "
            f"median {statistics.median(ratios):.2f}x (rounds: {shown})"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def shims() -> Iterator[dict[str, HeldShim]]:
    with HoldingUpstream() as upstream, contextlib.ExitStack() as stack:
        yield {mode: stack.enter_context(HeldShim(mode, upstream)) for mode in MODES}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one round of 1 s windows (a smoke run)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--seconds", type=float, default=4.0, help="measuring window per cell (default 4)")
    p.add_argument("--conns", type=int, default=32, help="wrk's connections (default 32)")
    args = p.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian package wrk): nothing to measure", file=sys.stderr)
        return 2
    rounds, seconds = (1, 1.0) if args.quick else (args.rounds, args.seconds)
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory() as tmp, shims() as running:
        scripts = {size: Path(tmp) / f"{size}.lua" for size in SIZES}
        for size, path in scripts.items():
            path.write_text(_wrk_script(_body(SIZES[size])))
        total = rounds * len(SIZES) * len(MODES)
        for r in range(rounds):
            for size in SIZES:
                # Alternate which shim goes first, so neither always runs on a warmer machine.
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    cell = measure(running[mode], size, scripts[size], args.conns, seconds)
                    cells.append(cell)
                    print(
                        f"  [{len(cells)}/{total}] round {r + 1}, {size} body, refused from the {mode}: "
                        f"{cell.rate:.0f} refusals/s, {cell.cpu_us:.0f} us of shim CPU each",
                        flush=True,
                    )
    print()
    print(f"Refusals with every slot taken and no queue ({args.conns} connections, {seconds:g} s windows):")
    print(report(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
