"""Can this machine drive the simulator's GPU profiles? Sim, load generator, shim, minimal relay, one run.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_sim_profile.py          # ~4 min
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_sim_profile.py --quick  # ~1 min

Starts ``llm-backoff-shim sim --profile P`` (answers of ``--max-tokens`` tokens, streamed)
and the light load generator (bench/_loadgen.py: asyncio + httptools, closed loop, one
stream per connection) on CPU 0, and on CPU 1 the shim (``serve``, cap above the
profile's sequences so it only relays) and the minimal uvicorn + aiohttp relay of
bench_upstream_clients.py. For each profile and each number of concurrent streams
(the offered load: the engine runs that many sequences; then the full batch on an engine
``--speedups`` times faster, to find where the machine gives out) it drives, one after
another, ``direct`` (load generator -> sim), ``relay`` and ``shim``, and reads per window:

- tokens/s delivered, against the profile's own model at that batch (its decode rate
  with N sequences, less the first token's ``ttft`` per request): below ~0.9 the machine
  no longer keeps up and measures itself, not the engine;
- CPU seconds of the sim, the load generator and the proxy over the window (cores), and
  the proxy's CPU per relayed token (one SSE event per token), the shim beside the relay.

Absolute figures move with the machine's other load; the shim/relay ratio within a run
is the result. Writes ``docs/img/sim-profile.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

import _procs
from llm_backoff_shim.sim.profiles import PROFILES

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOAD_CPU = 0
PROXY_CPU = 1
TARGETS = ("direct", "relay", "shim")


@dataclass
class Cell:
    profile: str
    speedup: float
    streams: int
    target: str
    tokens_per_s: float
    model_tokens_per_s: float
    completed: int
    errors: int
    sim_cores: float
    loadgen_cores: float
    proxy_cores: float | None

    @property
    def kept_up(self) -> float:
        return self.tokens_per_s / self.model_tokens_per_s

    @property
    def proxy_us_per_token(self) -> float | None:
        if self.proxy_cores is None or self.tokens_per_s <= 0:
            return None
        return self.proxy_cores / self.tokens_per_s * 1e6


def model_tokens_per_s(profile: str, streams: int, max_tokens: int, speedup: float = 1.0) -> float:
    """The profile's own rate with ``streams`` sequences: decode steps, first tokens ``ttft`` late."""
    p = PROFILES[profile]
    seqs = min(streams, int(p.defaults["max_num_seqs"]))  # type: ignore[call-overload]
    decode = p.decode_tokens_per_s(seqs) * speedup
    itl = seqs / decode
    ttft = float(p.defaults["ttft"]) / speedup  # type: ignore[arg-type]
    per_request = ttft + (max_tokens - 1) * itl
    return seqs * max_tokens / per_request


@contextlib.contextmanager
def servers(profile: str, speedup: float) -> Iterator[dict[str, tuple[str, Callable[[], float] | None]]]:
    """The sim (its ``--itl`` and ``--ttft`` divided by ``speedup``), the shim and the relay."""
    with contextlib.ExitStack() as stack:
        port = _procs.free_port()
        defaults = PROFILES[profile].defaults
        sim_argv = [
            sys.executable, "-m", "llm_backoff_shim.cli", "sim", "--host", "127.0.0.1", "--port", str(port),
            "--profile", profile, "--output-tokens-sigma", "0",
            "--itl", repr(float(defaults["itl"]) / speedup),  # type: ignore[arg-type]
            "--ttft", repr(float(defaults["ttft"]) / speedup),  # type: ignore[arg-type]
        ]  # fmt: skip
        sim = stack.enter_context(_procs.Child(f"sim {profile}", sim_argv, port, cpu=LOAD_CPU))
        seqs = int(PROFILES[profile].defaults["max_num_seqs"])  # type: ignore[call-overload]
        port = _procs.free_port()
        shim_argv = [
            sys.executable, "-m", "llm_backoff_shim.cli", "serve", "--upstream", f"http://{sim.address}",
            "--host", "127.0.0.1", "--port", str(port), "--max-concurrency", str(2 * seqs),
            "--max-queue", str(2 * seqs), "--log-level", "warning",
        ]  # fmt: skip
        shim = stack.enter_context(_procs.Child("shim", shim_argv, port, cpu=PROXY_CPU))
        port = _procs.free_port()
        relay_argv = [
            sys.executable, str(HERE / "bench_upstream_clients.py"), "--role", "aiohttp", "--port", str(port),
            "--upstream", f"http://{sim.address}",
        ]  # fmt: skip
        relay = stack.enter_context(_procs.Child("relay", relay_argv, port, cpu=PROXY_CPU))
        sim_pid = sim.pid
        yield {
            "sim": (sim.address, lambda: _procs.cpu_seconds(sim_pid)),
            "direct": (sim.address, None),
            "relay": (relay.address, lambda: _procs.cpu_seconds(relay.pid)),
            "shim": (shim.address, lambda: _procs.cpu_seconds(shim.pid)),
        }


def drive(
    address: str,
    streams: int,
    max_tokens: int,
    window: float,
    sim_cpu: Callable[[], float],
    proxy_cpu: Callable[[], float] | None,
) -> tuple[dict[str, float], float, float | None]:
    argv = [
        *_procs.pin_prefix(LOAD_CPU), sys.executable, str(HERE / "_loadgen.py"), "sse", "--target", address,
        "--streams", str(streams), "--max-tokens", str(max_tokens), "--warmup", "2",
        "--window", f"{window:g}",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    sim0 = proxy0 = 0.0
    result: dict[str, float] | None = None
    sim_s: float = 0.0
    proxy_s: float | None = None
    for line in proc.stdout:
        message = json.loads(line)
        if message.get("mark") == "start":
            sim0 = sim_cpu()
            proxy0 = proxy_cpu() if proxy_cpu else 0.0
        elif message.get("mark") == "end":
            sim_s = sim_cpu() - sim0
            proxy_s = proxy_cpu() - proxy0 if proxy_cpu else None
            result = message
    _, err = proc.communicate(timeout=60)
    if result is None:
        raise RuntimeError(f"load generator failed: {err[-2000:]}")
    return result, sim_s, proxy_s


def wait_idle(sim_address: str, timeout: float = 60.0) -> None:
    """Until the sim runs nothing: a relay that does not pass a client's departure upstream leaves
    its streams running in the engine after the load generator has gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(f"http://{sim_address}/sim/stats").json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("the simulator did not drain between cells")


def run(args: argparse.Namespace) -> list[Cell]:
    cells: list[Cell] = []
    levels: list[tuple[str, float, list[int]]] = []
    for profile in args.profiles:
        seqs = int(PROFILES[profile].defaults["max_num_seqs"])  # type: ignore[call-overload]
        levels.append((profile, 1.0, [n for n in args.streams if n < seqs] + [seqs]))
        levels += [(profile, k, [seqs]) for k in args.speedups]
    for profile, speedup, streams_list in levels:
        with servers(profile, speedup) as found:
            sim_address, sim_cpu = found["sim"]
            assert sim_cpu is not None
            for streams in streams_list:
                for target in TARGETS:
                    address, proxy_cpu = found[target]
                    wait_idle(sim_address)
                    data, sim_s, proxy_s = drive(
                        address, streams, args.max_tokens, args.window, sim_cpu, proxy_cpu
                    )
                    elapsed = float(data["elapsed"])
                    cell = Cell(
                        profile=profile,
                        speedup=speedup,
                        streams=streams,
                        target=target,
                        # Each stream is a role event, max_tokens token events and [DONE].
                        tokens_per_s=float(data["events"])
                        * args.max_tokens
                        / (args.max_tokens + 2)
                        / elapsed,
                        model_tokens_per_s=model_tokens_per_s(profile, streams, args.max_tokens, speedup),
                        completed=int(data["completed"]),
                        errors=int(data["errors"]),
                        sim_cores=sim_s / elapsed,
                        loadgen_cores=float(data["cpu_s"]) / elapsed,
                        proxy_cores=None if proxy_s is None else proxy_s / elapsed,
                    )
                    cells.append(cell)
                    proxy = "" if cell.proxy_cores is None else f"  proxy {cell.proxy_cores:.2f} cores"
                    print(
                        f"  {profile:9} x{speedup:<3g} {streams:4} streams  {target:6} "
                        f"{cell.tokens_per_s:7.0f} tokens/s "
                        f"({cell.kept_up:.2f} of the model's {cell.model_tokens_per_s:.0f})  sim "
                        f"{cell.sim_cores:.2f} cores  loadgen {cell.loadgen_cores:.2f}{proxy}  "
                        f"errors {cell.errors}",
                        flush=True,
                    )
    return cells


def table(cells: list[Cell]) -> str:
    lines = [
        "| profile | speed | streams | target | tokens/s | of the model's | sim cores | loadgen cores "
        "| proxy cores "
        "| proxy µs CPU per token |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        proxy = "" if c.proxy_cores is None else f"{c.proxy_cores:.2f}"
        per = "" if c.proxy_us_per_token is None else f"{c.proxy_us_per_token:.0f}"
        lines.append(
            f"| {c.profile} | x{c.speedup:g} | {c.streams} | {c.target} | {c.tokens_per_s:.0f} | "
            f"{c.kept_up:.2f} | "
            f"{c.sim_cores:.2f} | {c.loadgen_cores:.2f} | {proxy} | {per} |"
        )
    return "\n".join(lines)


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({c.profile for c in cells})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for profile in profiles:
        for target, style in zip(TARGETS, ("-o", "-s", "-^"), strict=True):
            mine = sorted(
                (c for c in cells if c.profile == profile and c.target == target),
                key=lambda c: c.model_tokens_per_s,
            )
            offered = [c.model_tokens_per_s for c in mine]
            axes[0].plot(offered, [c.kept_up for c in mine], style, label=f"{profile} {target}")
            if target != "direct":
                per = [c.proxy_us_per_token or 0.0 for c in mine]
                axes[1].plot(offered, per, style, label=f"{profile} {target}")
    axes[0].axhline(0.9, color="k", ls=":", lw=1)
    axes[0].set(xscale="log", xlabel="the engine's rate (profile's model), tokens/s",
                ylabel="delivered / model", title="does the machine keep up?")  # fmt: skip
    axes[1].set(xscale="log", xlabel="the engine's rate, tokens/s", ylabel="proxy CPU µs per relayed token",
                title="shim vs minimal relay")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpu-small only, 2 loads, 3 s windows")
    parser.add_argument("--profiles", default="gpu-small,gpu-large")
    parser.add_argument(
        "--streams",
        default="16,64",
        help="concurrent streams below the profile's sequences (which always run)",
    )
    parser.add_argument(
        "--speedups",
        default="2,4,8",
        help="then the full batch on an engine this many times faster (--itl, --ttft divided), to find "
        "the rate where this machine stops keeping up",
    )
    parser.add_argument("--max-tokens", type=int, default=200, help="answer length of every request")
    parser.add_argument("--window", type=float, default=5.0, help="seconds measured per cell")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "sim-profile.png")
    args = parser.parse_args()
    args.profiles = args.profiles.split(",")
    args.streams = [int(s) for s in args.streams.split(",") if s]
    args.speedups = [float(s) for s in args.speedups.split(",") if s]
    if args.quick:
        args.profiles, args.streams, args.speedups, args.window = ["gpu-small"], [16], [4.0], 3.0
    print(
        f"profiles {args.profiles}, streams {args.streams}, {args.max_tokens} tokens per answer", flush=True
    )
    started = time.monotonic()
    cells = run(args)
    print()
    print(table(cells))
    print(f"\n({time.monotonic() - started:.0f} s)")
    args.out.with_suffix(".json").write_text(json.dumps([asdict(c) for c in cells], indent=1))
    plot(cells, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
