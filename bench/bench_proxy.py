"""The shim's cost per request on loopback: against going direct, nginx and a minimal relay.

    .venv/bin/python bench/bench_proxy.py            # full run, about 3 minutes
    .venv/bin/python bench/bench_proxy.py --quick    # one short round of everything, about 1 minute

On 127.0.0.1 (``_harness.py``): the fake engine and the load generator (``wrk`` when installed,
else ``loadgen``) on CPU 0; the shim (never rejecting), nginx and the relay on CPU 1. Targets
interleaved round by round: added p50/p99 (proxy minus direct in the same round) and requests/s
at 1, 16, 64 connections; SSE events/s with 64 streams flat out; proxy CPU at 200 tokens/s.
Unless ``--nice 0`` every process gets its own autogroup at nice -10 (needs root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import RawDescriptionHelpFormatter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import _harness as harness
from llm_backoff_shim.lab.procs import cli_command

HERE = Path(__file__).resolve().parent
PROXY_CPU = 1
LOAD_CPU = 0
CONCURRENCIES = (1, 16, 64)
TARGETS = ("direct", "shim", "nginx", "relay")
PROXIES = ("shim", "nginx", "relay")
SSE_STREAMS = 64
#: The SSE phases: (name, events per stream, events/s per stream). Flat out: 64,000/s offered,
#: more than any target relays; 200 tokens/s: 2 s streams, then a new request on the same connection.
SSE_PHASES = (("max", 2000, 1000.0), ("200tok", 400, 200.0))

_WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '{"model":"bench","messages":[{"role":"user","content":"hi"}]}'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"errors":%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


# -- results ---------------------------------------------------------------------------------------
@dataclass
class HttpRun:
    target: str
    conns: int
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_s: float | None

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_us_per_request(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / max(self.requests, 1) * 1e6


@dataclass
class SseRun:
    target: str
    phase: str
    events: int
    reads: int
    streams: int
    seconds: float
    errors: int
    cpu_s: float | None

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds

    @property
    def events_per_read(self) -> float:
        """Above 1 when events reach the client batched (the relay fell behind and coalesced)."""
        return self.events / max(self.reads, 1)

    @property
    def cores(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / self.seconds

    @property
    def cpu_us_per_event(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / max(self.events, 1) * 1e6


@dataclass
class Results:
    http: list[HttpRun] = field(default_factory=list)
    sse: list[SseRun] = field(default_factory=list)


# -- load generation -------------------------------------------------------------------------------
class Runner:
    """Starts load-generator processes pinned and boosted like the servers."""

    def __init__(self, workdir: Path, *, nice: int | None, loadgen: str) -> None:
        self.nice, self.loadgen = nice, loadgen
        self.wrk_script = workdir / "post.lua"
        self.wrk_script.write_text(_WRK_SCRIPT)

    def _popen(self, argv: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*harness.pin_prefix(LOAD_CPU), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        if self.nice is not None:
            harness.boost(proc.pid, self.nice)
        return proc

    def http(
        self, target: str, address: str, conns: int, seconds: float, cpu: Callable[[], float] | None
    ) -> HttpRun:
        if self.loadgen == "wrk":
            argv = ["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "-s", str(self.wrk_script)]
            before = cpu() if cpu else 0.0
            proc = self._popen([*argv, f"http://{address}/v1/chat/completions"])
            out, err = proc.communicate(timeout=seconds + 30)
            cpu_s = cpu() - before if cpu else None
            d = _last_json(out, err, "wrk")
            p50, p99, took = d["p50_us"] / 1e3, d["p99_us"] / 1e3, d["duration_us"] / 1e6
            return HttpRun(target, conns, int(d["requests"]), took, p50, p99, int(d["errors"]), cpu_s)
        argv = _harness("loadgen", "http", "--target", address, "--conns", str(conns), "--warmup", "0.5")
        argv += ["--window", f"{seconds:g}"]
        d, cpu_s = self._marked(argv, seconds, cpu)
        p50, p99, took = float(d["p50_ms"]), float(d["p99_ms"]), float(d["elapsed"])
        return HttpRun(target, conns, int(d["completed"]), took, p50, p99, int(d["errors"]), cpu_s)

    def sse(
        self, target: str, phase: str, address: str, *, chunks: int, rate: float, seconds: float,
        cpu: Callable[[], float] | None,
    ) -> SseRun:  # fmt: skip
        argv = _harness("loadgen", "sse", "--target", address, "--streams", str(SSE_STREAMS))
        argv += ["--chunks", str(chunks), "--rate", str(rate), "--warmup", "1", "--window", f"{seconds:g}"]
        d, cpu_s = self._marked(argv, seconds, cpu)
        counts = int(d["events"]), int(d["reads"]), int(d["completed"])
        return SseRun(target, phase, *counts, float(d["elapsed"]), int(d["errors"]), cpu_s)

    def _marked(
        self, argv: list[str], seconds: float, cpu: Callable[[], float] | None
    ) -> tuple[dict[str, float], float | None]:
        """Run the harness's ``loadgen`` and read the proxy's CPU at its start and end marks."""
        proc = self._popen(argv)
        assert proc.stdout is not None
        before = after = 0.0
        result: dict[str, float] | None = None
        deadline = time.monotonic() + seconds + 30
        for line in proc.stdout:
            message = json.loads(line)
            if message.get("mark") == "start":
                before = cpu() if cpu else 0.0
            elif message.get("mark") == "end":
                after = cpu() if cpu else 0.0
                result = message
            if time.monotonic() > deadline:
                break
        _, err = proc.communicate(timeout=30)
        if result is None:
            raise RuntimeError(f"load generator failed: {err[-2000:]}")
        return result, (after - before if cpu else None)


def _last_json(out: str, err: str, name: str) -> dict[str, float]:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            parsed: dict[str, float] = json.loads(line)
            return parsed
    raise RuntimeError(f"{name} printed no result:\n{out[-1500:]}\n{err[-1500:]}")


# -- the run ---------------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    address: str
    cpu: Callable[[], float] | None


def _shim_argv(port: int, upstream: str) -> list[str]:
    flags = ["--max-concurrency", "1000", "--max-queue", "1000", "--log-level", "warning"]
    return cli_command(
        "serve", "--upstream", f"http://{upstream}", "--host", "127.0.0.1", "--port", str(port), *flags
    )


def _harness(role: str, *args: str) -> list[str]:
    return [sys.executable, str(HERE / "_harness.py"), role, *args]


@contextlib.contextmanager
def servers(workdir: Path, nice: int | None, wanted: tuple[str, ...]) -> Iterator[dict[str, Target]]:
    """The fake engine and the proxies in ``wanted``, running until the block ends."""
    with contextlib.ExitStack() as stack:
        upstream = harness.Child(
            "fake engine", lambda port: _harness("upstream", "--port", str(port)), cpu=LOAD_CPU, nice=nice
        )
        children = [stack.enter_context(upstream)]
        up = upstream.address
        argvs: dict[str, Callable[[int], Sequence[str]]] = {
            "shim": lambda port: _shim_argv(port, up),
            "nginx": lambda port: harness.nginx_argv(harness.nginx_config(workdir, port, up)),
            "relay": lambda port: _harness("relay", "--port", str(port), "--upstream", f"http://{up}"),
        }
        targets = {"direct": Target("direct", up, None)}
        for name in PROXIES:
            if name in wanted:
                child = stack.enter_context(harness.Child(name, argvs[name], cpu=PROXY_CPU, nice=nice))
                children.append(child)
                targets[name] = Target(name, child.address, child.cpu)
        if nice is not None and not all(child.boosted for child in children):
            print(f"note: could not set nice {nice} (not root?): figures will be noisier", flush=True)
        yield targets


def interleaved(names: tuple[str, ...], rounds: int) -> Iterator[str]:
    """Each name once a round, the order rotated by one each round."""
    for by in range(rounds):
        yield from names[by % len(names) :] + names[: by % len(names)]


def run(args: argparse.Namespace) -> Results:
    results = Results()
    nice = None if args.nice == 0 else args.nice
    names = tuple(t for t in TARGETS if t in args.targets)
    total = len(names) * args.rounds * (len(CONCURRENCIES) + 2)
    step = 0

    def progress(text: str) -> None:
        nonlocal step
        step += 1
        print(f"[{step:>3}/{total}] {text}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        workdir = Path(tmp)
        runner = Runner(workdir, nice=nice, loadgen=args.loadgen)
        with servers(workdir, nice, names) as targets:
            print(f"warming up {', '.join(names)} ...", flush=True)
            for name in names:
                runner.http(name, targets[name].address, 16, 1.0, None)
            for conns in CONCURRENCIES:
                for name in interleaved(names, args.rounds):
                    r = runner.http(name, targets[name].address, conns, args.seconds, targets[name].cpu)
                    results.http.append(r)
                    cpu = "" if r.cpu_s is None else f"  cpu {r.cpu_s / r.seconds:.2f} core"
                    progress(
                        f"{conns:>2} conns  {name:<6} p50 {r.p50_ms:7.3f} ms  p99 {r.p99_ms:7.3f} ms"
                        f"  {r.rps:9,.0f} req/s  errors {r.errors}{cpu}"
                    )
            for phase, chunks, rate in SSE_PHASES:
                for name in interleaved(names, args.rounds):
                    address, cpu_of = targets[name].address, targets[name].cpu
                    s = runner.sse(
                        name, phase, address, chunks=chunks, rate=rate, seconds=args.seconds, cpu=cpu_of
                    )
                    results.sse.append(s)
                    cpu = (
                        ""
                        if s.cpu_s is None
                        else f"  cpu {s.cores:.2f} core, {s.cpu_us_per_event:.1f} us/event"
                    )
                    progress(
                        f"sse {phase:<6} {name:<6} {s.events_per_s:9,.0f} events/s"
                        f"  {s.events_per_read:4.1f} events/read  errors {s.errors}{cpu}"
                    )
    return results


# -- report ----------------------------------------------------------------------------------------
def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _added(results: Results, conns: int, attr: str, name: str) -> float:
    """Median over rounds of (target percentile - direct percentile in the same round)."""
    mine = [r for r in results.http if r.target == name and r.conns == conns]
    direct = [r for r in results.http if r.target == "direct" and r.conns == conns]
    return _median([getattr(a, attr) - getattr(b, attr) for a, b in zip(mine, direct, strict=False)])


def _http(results: Results, conns: int, attr: str, name: str) -> float:
    runs = [r for r in results.http if r.target == name and r.conns == conns]
    return _median([v for r in runs if (v := getattr(r, attr)) is not None])


def _sse(results: Results, phase: str, attr: str, name: str) -> float:
    runs = [s for s in results.sse if s.target == name and s.phase == phase]
    return _median([v for s in runs if (v := getattr(s, attr)) is not None])


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value != value else format(value, spec)  # NaN: not measured


def report(results: Results, targets: tuple[str, ...]) -> str:
    proxies = [t for t in PROXIES if t in targets]
    pairs = [("shim", "nginx")] if {"shim", "nginx"} <= set(targets) else []  # against the reference proxy
    header = "| measure | " + " | ".join(targets) + " |" + "".join(f" {a} / {b} |" for a, b in pairs)
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]

    def row(label: str, spec: str, names: Sequence[str], value: Callable[[str], float]) -> None:
        values = {t: value(t) for t in names}
        cells = [_fmt(values.get(t, float("nan")), spec) for t in targets]
        for a, b in pairs:
            top, bottom = values.get(a, float("nan")), values.get(b, float("nan"))
            cells.append(_fmt(top / bottom if bottom else float("nan"), ".2f"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for conns in CONCURRENCIES:
        for attr in ("p50_ms", "p99_ms"):
            added = partial(_added, results, conns, attr)
            row(f"added {attr[:3]} at {conns} conc. (ms)", ".3f", proxies, added)
    for conns in CONCURRENCIES:
        row(f"requests/s at {conns} conc.", ",.0f", targets, partial(_http, results, conns, "rps"))
    per_request = partial(_http, results, 64, "cpu_us_per_request")
    row("proxy CPU per request at 64 conc. (µs)", ",.0f", proxies, per_request)
    for phase, label, cores in (
        ("max", "SSE events/s relayed, 64 streams flat out", ".2f"),
        ("200tok", "SSE events/s, 64 streams at 200 tokens/s", ".3f"),
    ):
        row(label, ",.0f", targets, partial(_sse, results, phase, "events_per_s"))
        row("  proxy cores used", cores, proxies, partial(_sse, results, phase, "cores"))
        row("  proxy CPU per event (µs)", ".1f", proxies, partial(_sse, results, phase, "cpu_us_per_event"))
    errors = sum(r.errors for r in results.http) + sum(s.errors for s in results.sse)
    lines += ["", f"errors (non-200, incomplete streams, socket errors) over the whole run: {errors}"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--quick", action="store_true", help="one round of 2 s windows (a smoke run)")
    add("--rounds", type=int, default=None, help="interleaved rounds per measure (default 3)")
    add("--seconds", type=float, default=None, help="measuring window of each run (default 4)")
    add("--nice", type=int, default=-10, help="autogroup nice of every process of the run (0: leave alone)")
    wrk = "wrk" if shutil.which("wrk") else "python"
    add("--loadgen", choices=("wrk", "python"), default=wrk, help="load generator of the request phases")
    add("--targets", default=",".join(TARGETS), help="comma-separated subset of " + ",".join(TARGETS))
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.seconds = args.seconds or (2.0 if args.quick else 4.0)
    args.targets = tuple(t for t in TARGETS if t in args.targets.split(","))
    if "nginx" in args.targets and not Path(harness.NGINX).exists():
        print(f"{harness.NGINX} not found: install nginx or pass --targets direct,shim", file=sys.stderr)
        return 2
    pinned = bool(harness.pin_prefix(PROXY_CPU))
    print(
        f"load generator: {args.loadgen}; proxies pinned to CPU {PROXY_CPU}: {'yes' if pinned else 'no'}; "
        f"{args.rounds} round(s) of {args.seconds:g} s windows; nice {args.nice}; {os.cpu_count()} CPUs",
        flush=True,
    )
    started = time.monotonic()
    results = run(args)
    print()
    print(report(results, args.targets))
    print(f"\n(took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
