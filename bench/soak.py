"""The longer soak with faults (opt-in; the CI-sized one is server_shim/tests/lab/test_soak.py).

    .venv/bin/python bench/soak.py --requests 20000 --seconds 300
    .venv/bin/python bench/soak.py --quick          # 1500 requests, about a minute

Three runs (``llm_backoff_shim.lab.soak``), each with its own faulty simulator and shim: ``mix``
(every kind of client through the shim), ``sdk-direct`` (wrapped openai clients straight to the
simulator) and ``sdk-shim`` (the same through the shim). A table of outcomes, faults, hangs,
duplicated output, retries after a stream began, the leak audit and RSS; exit status 1 if
anything leaked, hung or duplicated. ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from llm_backoff_shim.lab.soak import Snapshot, SoakConfig, SoakReport, run_soak

SDK_ONLY = (("sdk", 0.5), ("sdk_stream", 0.5))


def _progress(name: str) -> Any:
    started = time.monotonic()
    return lambda line: print(f"[{time.monotonic() - started:6.1f} s] {name}: {line}", flush=True)


def _share(report: SoakReport, prefix: str) -> str:
    n = sum(v for k, v in report.outcomes.items() if k.startswith(prefix))
    return f"{n} ({100 * n / max(1, report.requests):.1f} %)"


def _table(runs: dict[str, SoakReport]) -> str:
    names = list(runs)
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cell: Any) -> None:
        rows.append((label, [str(cell(r)) for r in runs.values()]))

    row("requests", lambda r: r.requests)
    row("seconds", lambda r: f"{r.seconds:.0f}")
    faults = ("errors", "resets", "slow_first_byte", "stream_cuts")
    injected = "faults injected (500 / reset / slow first byte / stream cut)"
    row(injected, lambda r: " / ".join(str(r.faults.get(k, 0)) for k in faults))
    left = ("client_left", "client_left_stream")
    row("client disconnects (queued / mid-stream)", lambda r: " / ".join(str(r.outcomes[k]) for k in left))
    row("succeeded", lambda r: _share(r, "ok"))
    row("HTTP error answers (429/503/500...)", lambda r: _share(r, "status:"))
    row("SDK error raised after retrying", lambda r: _share(r, "sdk_"))
    row("transport error (cut stream, reset)", lambda r: _share(r, "error:"))
    row("hangs past deadline + grace", lambda r: r.hangs)
    row("untyped errors", lambda r: len(r.untyped))
    row("duplicated stream output", lambda r: r.duplicate_streams)
    row("retries after a stream began", lambda r: r.retries_after_stream_start)
    row("gauges after (in flight, queued)", lambda r: r.gauges_after if any(r.gauges_after.values()) else "0")

    def change(label: str, show: Callable[[Snapshot], str]) -> None:
        row(label, lambda r: f"{show(r.baseline)} -> {show(r.after)}" if r.baseline and r.after else "-")

    change("tasks shim/sim before -> after", lambda s: f"{s.tasks_shim}/{s.tasks_sim}")
    change("file descriptors before -> after", lambda s: str(s.fds))
    change("RSS MiB after warm-up -> after", lambda s: f"{s.rss_mib:.1f}")
    row("leaks found", lambda r: len(r.leaks()))
    width = max(len(label) for label, _ in rows)
    lines = [
        "| " + "measure".ljust(width) + " | " + " | ".join(names) + " |",
        "| " + "-" * width + " |" + "|".join(" --- " for _ in names) + "|",
    ]
    lines += ["| " + label.ljust(width) + " | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--requests", type=int, default=20000, help="of the mixed run (the SDK runs: a fifth each)")
    add("--seconds", type=float, default=300.0, help="stop sending new requests after this long")
    add("--concurrency", type=int, default=48)
    add("--seed", type=int, default=7)
    add("--quick", action="store_true", help="1500 requests, 60 s cap")
    add("--json", help="write all figures to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.seconds = 1500, 60.0
    base = SoakConfig(
        requests=args.requests, seconds=args.seconds, concurrency=args.concurrency, seed=args.seed
    )
    sdk_requests = max(200, args.requests // 5)
    plans = {
        "mix": base,
        "sdk-direct": replace(base, requests=sdk_requests, kinds=SDK_ONLY, through_shim=False),
        "sdk-shim": replace(base, requests=sdk_requests, kinds=SDK_ONLY),
    }
    runs: dict[str, SoakReport] = {}
    for name, config in plans.items():
        limits = f"at most {config.seconds:g} s, concurrency {config.concurrency}"
        print(f"== {name}: {config.requests} requests, {limits}", flush=True)
        runs[name] = run_soak(config, progress=_progress(name))
        print(json.dumps(runs[name].summary(), indent=1), flush=True)
    print()
    print(_table(runs))
    rss = runs["mix"].rss_samples
    if rss:
        print(f"\nmix RSS every tenth (requests sent, MiB): {rss}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({name: r.summary() for name, r in runs.items()}, out, indent=1)
    bad = [
        name
        for name, r in runs.items()
        if r.leaks() or r.hangs or r.late or r.untyped or r.duplicate_streams or r.retries_after_stream_start
    ]
    if bad:
        print(f"\nFAILED: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
