"""CPU per refusal, per admitted request and per SSE chunk, access log on and off, against references.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_cheap_answers.py           # ~4 min
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_cheap_answers.py --quick   # ~1 min

Every server is a child process pinned to CPU 1 (load generators and fake engines on CPU 0),
measured as its user + system CPU over the measuring window divided by what it answered;
targets are interleaved round by round, and the ratios are taken within a round, so the
machine's drift hits both sides of a ratio alike. Three phases:

1. refusals: a shim with its one slot held by a request its upstream never answers and no
   queue (every answer a 429 ``queue_full``), access log on (``--log-level info``, lines to a
   file) and off, against ``_asgi_429.py`` (a 15-line ASGI app answering 429 without reading
   the body) on the same server (uvicorn, uvloop, httptools), its access log off and on;
   ``wrk`` with 32 connections and a small chat body;
2. admitted requests: a shim in front of ``_fast_upstream.py`` (admission never refuses),
   log on and off, against the minimal uvicorn + aiohttp relay (``bench_upstream_clients.py
   --role aiohttp``); ``wrk`` with 64 connections;
3. SSE: 64 streams of 200 events/s through the same three (``_loadgen.py sse``), CPU per event.

The targets, as ratios: refusal with the log on <= 2.5x the 429 app (log off); the
log adds <= 10 % to an admitted request; the shim's CPU per admitted request and per chunk
<= the relay's. A table and a PNG (``--plot``) are written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import _procs
from bench_proxy import Runner
from bench_refusals import HoldingUpstream, _body, _wrk_script

HERE = Path(__file__).resolve().parent
SERVER_CPU, LOAD_CPU = (1, 0) if (os.cpu_count() or 1) >= 2 else (None, None)
REFUSERS = ("shim log on", "shim log off", "429 app", "429 app + uvicorn log")
RELAYS = ("shim log on", "shim log off", "relay")


@dataclass
class Cell:
    phase: str
    target: str
    round: int
    answers: int
    cpu_s: float

    @property
    def cpu_us(self) -> float:
        return self.cpu_s / self.answers * 1e6 if self.answers else float("nan")


def _shim(name: str, upstream: str, log_on: bool, extra: list[str]) -> _procs.Child:
    port = _procs.free_port()
    argv = [
        sys.executable, "-m", "llm_backoff_shim.cli", "serve", "--upstream", upstream,
        "--host", "127.0.0.1", "--port", str(port), *extra,
        "--log-level", "info" if log_on else "warning", "--access-log", "true" if log_on else "false",
    ]  # fmt: skip
    return _procs.Child(name, argv, port, cpu=SERVER_CPU)


def _held(child: _procs.Child) -> socket.socket:
    """Take the shim's one slot with a request its upstream never answers."""
    body = _body(40).encode()
    holder = socket.create_connection(("127.0.0.1", child.port), timeout=10)
    holder.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: shim\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )
    time.sleep(0.5)
    return holder


def _wrk(address: str, script: Path, conns: int, seconds: float) -> int:
    argv = [*_procs.pin_prefix(LOAD_CPU), "wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "-s", str(script)]
    out = subprocess.run(
        [*argv, f"http://{address}/v1/chat/completions"],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
        check=True,
    ).stdout
    return int(json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["requests"])


def measured(phase: str, target: str, rnd: int, child: _procs.Child, load: Callable[[], int]) -> Cell:
    before = child.cpu()
    answers = load()
    return Cell(phase, target, rnd, answers, child.cpu() - before)


@contextlib.contextmanager
def refusers() -> Iterator[dict[str, _procs.Child]]:
    with HoldingUpstream() as upstream, contextlib.ExitStack() as stack:
        url = f"http://127.0.0.1:{upstream.port}"
        held = ["--max-concurrency", "1", "--max-queue", "0"]
        children = {
            "shim log on": _shim("shim log on", url, True, held),
            "shim log off": _shim("shim log off", url, False, held),
        }
        for name, flags in (("429 app", []), ("429 app + uvicorn log", ["--access-log"])):
            port = _procs.free_port()
            argv = [sys.executable, str(HERE / "_asgi_429.py"), "--port", str(port), *flags]
            children[name] = _procs.Child(name, argv, port, cpu=SERVER_CPU)
        for name, child in children.items():
            stack.enter_context(child)
            if name.startswith("shim"):
                stack.callback(_held(child).close)
        yield children


@contextlib.contextmanager
def relays() -> Iterator[dict[str, _procs.Child]]:
    up_port = _procs.free_port()
    engine = _procs.Child(
        "fast engine",
        [sys.executable, str(HERE / "_fast_upstream.py"), "--port", str(up_port)],
        up_port,
        cpu=LOAD_CPU,
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(engine)
        url = f"http://{engine.address}"
        wide = ["--max-concurrency", "1000", "--max-queue", "1000"]
        port = _procs.free_port()
        relay_argv = [
            sys.executable, str(HERE / "bench_upstream_clients.py"), "--role", "aiohttp",
            "--port", str(port), "--upstream", url,
        ]  # fmt: skip
        children = {
            "shim log on": _shim("shim log on", url, True, wide),
            "shim log off": _shim("shim log off", url, False, wide),
            "relay": _procs.Child("relay", relay_argv, port, cpu=SERVER_CPU),
        }
        for child in children.values():
            stack.enter_context(child)
        yield children


def run(args: argparse.Namespace) -> list[Cell]:
    cells: list[Cell] = []
    rounds, seconds = args.rounds, args.seconds
    total = rounds * (len(REFUSERS) + 2 * len(RELAYS))

    def record(cell: Cell) -> None:
        cells.append(cell)
        print(
            f"[{len(cells):>2}/{total}] round {cell.round + 1} {cell.phase:<8} {cell.target:<22} "
            f"{cell.answers:>8} answers  {cell.cpu_us:7.1f} us of CPU each",
            flush=True,
        )

    with tempfile.TemporaryDirectory(prefix="bench-cheap-") as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(_wrk_script(_body(40)))
        with refusers() as children:
            for child in children.values():
                _wrk(child.address, script, 32, 1.0)  # warm-up
            for rnd in range(rounds):
                order = REFUSERS if rnd % 2 == 0 else REFUSERS[::-1]
                for name in order:
                    child = children[name]
                    record(
                        measured(
                            "refusal", name, rnd, child, lambda c=child: _wrk(c.address, script, 32, seconds)
                        )
                    )
        runner = Runner(Path(tmp), nice=None, loadgen="wrk")
        with relays() as children:
            for child in children.values():
                _wrk(child.address, runner.wrk_script, 64, 1.0)
            for rnd in range(rounds):
                order = RELAYS if rnd % 2 == 0 else RELAYS[::-1]
                for name in order:
                    child = children[name]
                    run_ = runner.http(name, child.address, 64, seconds, child.cpu)
                    assert run_.cpu_s is not None
                    record(Cell("request", name, rnd, run_.requests, run_.cpu_s))
                for name in order:
                    child = children[name]
                    sse = runner.sse(
                        name, "200tok", child.address, chunks=400, rate=200.0, seconds=seconds, cpu=child.cpu
                    )
                    assert sse.cpu_s is not None
                    record(Cell("sse", name, rnd, sse.events, sse.cpu_s))
    return cells


def ratios(cells: list[Cell], phase: str, top: str, bottom: str) -> list[float]:
    """Per round: CPU per answer of ``top`` over ``bottom``, measured in the same round."""
    by = {(c.target, c.round): c.cpu_us for c in cells if c.phase == phase}
    rounds = sorted({c.round for c in cells})
    return [by[(top, r)] / by[(bottom, r)] for r in rounds if (top, r) in by and (bottom, r) in by]


def report(cells: list[Cell]) -> tuple[str, list[tuple[str, float, float]]]:
    lines = ["| phase | server | CPU per answer (median) |", "| --- | --- | ---: |"]
    unit = {"refusal": "us", "request": "us", "sse": "us"}
    for phase, names in (("refusal", REFUSERS), ("request", RELAYS), ("sse", RELAYS)):
        for name in names:
            values = [c.cpu_us for c in cells if c.phase == phase and c.target == name]
            lines.append(f"| {phase} | {name} | {statistics.median(values):.1f} {unit[phase]} |")
    checks = [
        ("refusal, shim log on / 429 app", ratios(cells, "refusal", "shim log on", "429 app"), 2.5),
        (
            "refusal, shim log on / 429 app + uvicorn log",
            ratios(cells, "refusal", "shim log on", "429 app + uvicorn log"),
            2.5,
        ),
        ("request, shim log on / log off", ratios(cells, "request", "shim log on", "shim log off"), 1.10),
        ("request, shim log on / relay", ratios(cells, "request", "shim log on", "relay"), 1.0),
        ("sse chunk, shim log on / relay", ratios(cells, "sse", "shim log on", "relay"), 1.0),
    ]
    lines += [
        "",
        "| ratio (same round) | median | rounds | target | met |",
        "| --- | ---: | --- | ---: | --- |",
    ]
    summary = []
    for label, values, target in checks:
        median = statistics.median(values)
        shown = ", ".join(f"{v:.2f}" for v in values)
        lines.append(
            f"| {label} | {median:.2f} | {shown} | <= {target:g} | {'yes' if median <= target else 'no'} |"
        )
        summary.append((label, median, target))
    return "\n".join(lines), summary


def plot(summary: list[tuple[str, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [label for label, _, _ in summary]
    ax.barh(labels, [median for _, median, _ in summary], color="tab:blue", label="measured (median)")
    ax.scatter(
        [target for _, _, target in summary], labels, color="tab:red", marker="|", s=400, label="target"
    )
    ax.invert_yaxis()
    ax.set_xlabel("ratio of CPU per answer, same round")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one round of 2 s windows (a smoke run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0, help="measuring window per cell")
    p.add_argument("--plot", type=Path, default=None, help="write the ratios as a PNG here")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 2.0
    for tool in ("wrk", "taskset"):
        if tool == "wrk" and subprocess.run(["which", tool], capture_output=True).returncode != 0:
            print("wrk is not installed (Debian package wrk): nothing to measure", file=sys.stderr)
            return 2
    cells = run(args)
    table, summary = report(cells)
    print()
    print(table)
    if args.plot is not None:
        plot(summary, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
