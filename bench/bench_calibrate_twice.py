"""Is calibrate's recommendation earned? Two runs on the same engine, side by side.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate_twice.py --engine fast
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_calibrate_twice.py --engine slow

Starts the simulator set up as one engine (``ENGINES``), runs ``llm-backoff-shim calibrate``
against it twice with different seeds (so the two runs draw different requests), and prints
each run's recommended ``--max-concurrency`` and ``--max-inflight-tokens``, its confidence,
its measurements and how long it took, and the larger of the two relative differences
(the target: within 15 %). Both runs share one ``--out`` (``OUT/ENGINE``, its runs' file
emptied first), so the second run's confidence is earned against the first, as calibrate's
is (docs/calibrate.md, 'Across runs'); each run's own verdict is printed beside it. Writes
the table as JSON into ``--out``.

Engines:

- ``fast``: 8 sequences, 8 ms per token alone, 10 % slower per extra sequence; chat traffic
  (calibrate's default lengths): a request takes about a second.
- ``slow``: the GPU box of a slow engine at half its time scale: 16 sequences, 15 ms per
  token alone and 14.9 % slower per extra sequence (44 ms per token at 14 sequences, the
  full-scale box's 88 ms halved), answers of median 128 tokens: about 6.5 s a request at
  14 sequences (the full-scale box: 13 s), with 20 % of the prompts 1500-3000 words long.
  ``--scale 1`` runs it at full scale (a sweep then takes about twice as long).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

from llm_backoff_shim.lab import calibrate
from llm_backoff_shim.lab.calibrate_history import HISTORY_NAME
from llm_backoff_shim.lab.procs import sim_server


def engine(name: str, scale: float) -> tuple[list[str], list[str]]:
    """(simulator flags, calibrate flags) of an engine."""
    if name == "fast":
        sim = ["--max-num-seqs", "8", "--ttft", "0.02", "--itl", "0.008", "--itl-batch-factor", "0.1",
               "--prefill-time-per-token", "0.0001", "--seed", "1"]  # fmt: skip
        return sim, ["--ttft-slo", "1", "--tpot-slo", "0.1", "--max-level", "64"]
    itl = 0.030 * scale
    sim = ["--max-num-seqs", "16", "--ttft", f"{0.1 * scale:g}", "--itl", f"{itl:g}",
           "--itl-batch-factor", "0.149", "--prefill-time-per-token", f"{0.0002 * scale:g}",
           "--max-num-batched-tokens", "2048", "--seed", "1"]  # fmt: skip
    flags = ["--ttft-slo", f"{4 * scale:g}", "--tpot-slo", f"{0.2 * scale:g}", "--max-level", "64",
             "--output-tokens", "lognormal:128:0.6:16-512", "--long-share", "0.2",
             "--long-prompt-words", "1500-3000", "--max-seconds", "1800"]  # fmt: skip
    return sim, flags


def run_once(url: str, flags: list[str], seed: int, out: Path) -> dict[str, Any]:
    stdout, stderr = io.StringIO(), io.StringIO()
    argv = ["--upstream", url, *flags, "--seed", str(seed), "--out", str(out), "--json"]
    began = time.monotonic()
    status = calibrate.main(argv, stdout=stdout, stderr=stderr)
    seconds = time.monotonic() - began
    print(stderr.getvalue(), end="", flush=True)
    result: dict[str, Any] = json.loads(stdout.getvalue()) if stdout.getvalue().strip() else {}
    rec = result.get("recommendation") or {}
    return {
        "seed": seed,
        "status": status,
        "max_concurrency": rec.get("max_concurrency"),
        "max_inflight_tokens": rec.get("max_inflight_tokens"),
        "confidence": result.get("confidence"),
        "confidence_reason": result.get("confidence_reason"),
        "confidence_within_run": result.get("confidence_within_run"),
        "measurements": len(result.get("steps", [])),
        "seconds": seconds,
        "plan": result.get("plan"),
        "command": rec.get("command"),
    }


def apart(a: float | None, b: float | None) -> float | None:
    """|a - b| over their mean."""
    if a is None or b is None or a + b == 0:
        return None
    return abs(a - b) / ((a + b) / 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("fast", "slow"), required=True)
    p.add_argument("--scale", type=float, default=0.5, help="time scale of the slow engine (default 0.5)")
    p.add_argument("--seeds", default="0,1", help="the two runs' seeds (default 0,1)")
    p.add_argument("--out", type=Path, default=Path("/tmp/calibrate-twice"))
    args = p.parse_args(argv)
    sim_flags, flags = engine(args.engine, args.scale)
    seeds = [int(x) for x in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    shared = args.out / args.engine
    (shared / HISTORY_NAME).unlink(missing_ok=True)  # these two runs, not an earlier bench's
    runs = []
    with sim_server(sim_flags) as sim:
        print(f"simulator: {' '.join(sim_flags)}\ncalibrate: {' '.join(flags)}", flush=True)
        for seed in seeds:
            print(f"--- calibrate, seed {seed}", flush=True)
            runs.append(run_once(sim.url, flags, seed, shared))
    print(
        "\n| run | seed | --max-concurrency | --max-inflight-tokens | confidence (within the run) "
        "| measurements | took |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|")
    for i, r in enumerate(runs, 1):
        print(
            f"| {i} | {r['seed']} | {r['max_concurrency']} | {r['max_inflight_tokens']} | {r['confidence']} "
            f"({r['confidence_within_run']}) | {r['measurements']} | {r['seconds']:.0f} s |"
        )
    if len(runs) == 2:
        a, b = runs
        conc = apart(a["max_concurrency"], b["max_concurrency"])
        cost = apart(a["max_inflight_tokens"], b["max_inflight_tokens"])
        print(
            f"\napart: --max-concurrency {'-' if conc is None else f'{conc:.0%}'}, "
            f"--max-inflight-tokens {'-' if cost is None else f'{cost:.0%}'} (target: within 15 %)"
        )
    (args.out / f"{args.engine}.json").write_text(
        json.dumps({"sim_flags": sim_flags, "flags": flags, "runs": runs}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
