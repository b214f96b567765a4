"""What the public serving path costs: the shim on its fast path vs its public path vs a minimal relay.

    .venv/bin/python bench/bench_serving_paths.py            # 3 rounds, about 2 minutes
    .venv/bin/python bench/bench_serving_paths.py --quick    # 1 round of 2 s windows

The same processes and load as bench_proxy.py (fast fake engine and load generator on
CPU 0, each proxy pinned to CPU 1, targets interleaved round by round), three targets:

- ``fast``: ``llm-backoff-shim serve --http-path fast`` (uvicorn's httptools protocol, extended);
- ``public``: ``llm-backoff-shim serve --http-path public`` (uvicorn's h11 protocol, public API);
- ``relay``: the minimal uvicorn + aiohttp relay of bench_upstream_clients.py (uvicorn's
  defaults: httptools), the reference the issue compares against.

Measured: proxy CPU per non-streaming request at 64 connections and per SSE event
(64 streams, as fast as the target relays), median over rounds. Absolute figures vary
with the machine's other load; the ratios in one run are the result.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import _procs
import bench_proxy as bp

TARGETS = ("fast", "public", "relay")
CONNS = 64


@contextlib.contextmanager
def servers(workdir: Path, nice: int | None) -> Iterator[dict[str, bp.Target]]:
    up_port = _procs.free_port()
    upstream = _procs.Child(
        "fake engine",
        [sys.executable, str(bp.HERE / "_fast_upstream.py"), "--port", str(up_port)],
        up_port,
        cpu=bp.LOAD_CPU,
        nice=nice,
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(upstream)
        targets: dict[str, bp.Target] = {}
        for path in ("fast", "public"):
            port = _procs.free_port()
            argv = [*bp._shim_argv(port, upstream.address), "--http-path", path]
            child = _procs.Child(f"shim ({path})", argv, port, cpu=bp.PROXY_CPU, nice=nice)
            shim = stack.enter_context(child)
            targets[path] = bp.Target(path, shim.address, shim.cpu)
        port = _procs.free_port()
        argv = [
            sys.executable,
            str(bp.HERE / "bench_upstream_clients.py"),
            "--role",
            "aiohttp",
            "--port",
            str(port),
            "--upstream",
            f"http://{upstream.address}",
        ]
        relay = stack.enter_context(_procs.Child("reference relay", argv, port, cpu=bp.PROXY_CPU, nice=nice))
        targets["relay"] = bp.Target("relay", relay.address, relay.cpu)
        yield targets


def plot(path: Path, per_request: dict[str, float], per_event: dict[str, float], rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = ["fast path", "public path", "uvicorn + aiohttp relay"]
    colours = ["tab:blue", "tab:orange", "tab:grey"]
    for ax, values, title in (
        (axes[0], per_request, f"CPU per request, {CONNS} connections (µs)"),
        (axes[1], per_event, "CPU per SSE event, 64 streams (µs)"),
    ):
        heights = [values[t] for t in TARGETS]
        bars = ax.bar(labels, heights, color=colours)
        ax.bar_label(bars, fmt="%.1f")
        ax.margins(y=0.12)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"The shim's serving paths, proxy on one core (medians of {rounds} rounds)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="one round of 2 s windows")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    parser.add_argument("--seconds", type=float, default=None, help="measuring window (default 4)")
    parser.add_argument("--nice", type=int, default=-10, help="autogroup nice of every process (0: leave)")
    parser.add_argument(
        "--plot", type=Path, default=bp.HERE.parent / "docs" / "img" / "serving-paths.png", help="PNG out"
    )
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (2.0 if args.quick else 4.0)
    nice = None if args.nice == 0 else args.nice
    loadgen = "wrk" if shutil.which("wrk") else "python"
    started = time.monotonic()
    per_request: dict[str, list[float]] = {t: [] for t in TARGETS}
    per_event: dict[str, list[float]] = {t: [] for t in TARGETS}
    rps: dict[str, list[float]] = {t: [] for t in TARGETS}
    with tempfile.TemporaryDirectory(prefix="bench-paths-") as tmp:
        runner = bp.Runner(Path(tmp), nice=nice, loadgen=loadgen)
        with servers(Path(tmp), nice) as targets:
            print(f"load generator {loadgen}; {rounds} round(s) of {seconds:g} s; warming up ...", flush=True)
            for name in TARGETS:
                runner.http(name, targets[name].address, 16, 1.0, None)
            for rnd in range(rounds):
                for name in bp.rotated(TARGETS, rnd):
                    target = targets[name]
                    r = runner.http(name, target.address, CONNS, seconds, target.cpu)
                    assert r.cpu_us_per_request is not None
                    per_request[name].append(r.cpu_us_per_request)
                    rps[name].append(r.rps)
                    print(
                        f"round {rnd + 1} {name:<6} {r.rps:8,.0f} req/s  "
                        f"{r.cpu_us_per_request:6.1f} us/request  errors {r.errors}",
                        flush=True,
                    )
                for name in bp.rotated(TARGETS, rnd):
                    target = targets[name]
                    s = runner.sse(
                        name,
                        "max",
                        target.address,
                        chunks=bp.SSE_MAX_CHUNKS,
                        rate=bp.SSE_MAX_RATE,
                        seconds=seconds,
                        cpu=target.cpu,
                    )
                    assert s.cpu_us_per_event is not None
                    per_event[name].append(s.cpu_us_per_event)
                    print(
                        f"round {rnd + 1} {name:<6} {s.events_per_s:8,.0f} events/s  "
                        f"{s.cpu_us_per_event:6.1f} us/event  errors {s.errors}",
                        flush=True,
                    )
    med = {name: statistics.median(values) for name, values in per_request.items()}
    med_event = {name: statistics.median(values) for name, values in per_event.items()}
    print()

    def row(label: str, cells: list[str]) -> None:
        print(f"| {label} | " + " | ".join(cells) + " |")

    row(f"medians of {rounds} round(s)", list(TARGETS))
    print("|---|" + "---|" * len(TARGETS))
    row(f"requests/s, {CONNS} connections", [f"{statistics.median(rps[t]):,.0f}" for t in TARGETS])
    row(f"CPU per request, {CONNS} connections (us)", [f"{med[t]:.0f}" for t in TARGETS])
    row("CPU per SSE event (us)", [f"{med_event[t]:.1f}" for t in TARGETS])
    row(
        "ratio to the relay, per request / per event",
        [f"{med[t] / med['relay']:.2f} / {med_event[t] / med_event['relay']:.2f}" for t in TARGETS],
    )
    plot(args.plot, med, med_event, rounds)
    print(f"plot: {args.plot}")
    print(f"\n(took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
