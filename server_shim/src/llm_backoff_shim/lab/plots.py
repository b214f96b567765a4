"""One PNG for a set of runs: a row per configuration; latency, queue depth and rejections over time.

Columns share their y axis across rows, so the runs can be compared by eye.
Matplotlib (the ``lab`` extra) runs on the Agg backend (no display needed); it is imported
only when a plot is drawn, so this module imports without it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from llm_backoff_shim.lab.extra import require_plotting
from llm_backoff_shim.lab.load_records import RunResult

BIN = 0.5


def _counts(times: Sequence[float], end: float) -> tuple[list[float], list[float]]:
    bins = max(1, int(end / BIN) + 1)
    counts = [0.0] * bins
    for t in times:
        i = int(t / BIN)
        if 0 <= i < bins:
            counts[i] += 1 / BIN
    return [i * BIN for i in range(bins)], counts


def save_plot(results: Sequence[RunResult], path: Path, *, title: str) -> Path:
    """Draw ``results`` into ``path``; :class:`~llm_backoff_shim.lab.extra.MissingLabExtraError`
    without matplotlib."""
    require_plotting(f"the plot {path.name}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(n, 3, figsize=(15, 3.2 * n + 0.8), sharex=True, squeeze=False)
    end = max((r.elapsed for r in results), default=1.0)
    for row, result in enumerate(results):
        lat, queue, rej = axes[row]
        scenario = result.scenario
        for cls, colour in (("interactive", "tab:blue"), ("batch", "tab:green")):
            ok = [c for c in result.calls if c.cls == cls and c.ok and c.ttft is not None]
            lat.scatter(
                [c.start for c in ok], [c.ttft for c in ok], s=9, color=colour, label=f"TTFT {cls} (ok)"
            )
        failed = [c for c in result.calls if not c.ok and c.duration is not None]
        lat.scatter(
            [c.start for c in failed],
            [c.duration for c in failed],
            s=14,
            marker="x",
            color="tab:red",
            label="failed: time to failure",
        )
        deadlines = {scenario.deadline_of("interactive"): "", scenario.deadline_of("batch"): " (batch)"}
        if len(deadlines) > 1:
            deadlines[scenario.deadline_of("interactive")] = " (interactive)"
        for deadline, whose in deadlines.items():
            lat.axhline(
                deadline, color="grey", linestyle="--", linewidth=1, label=f"deadline {deadline:g} s{whose}"
            )
        lat.set_ylabel(result.setup.label + "\nseconds", fontsize=9)
        samples = result.samples
        queue.plot(
            [s.t for s in samples],
            [s.engine_waiting or 0 for s in samples],
            color="tab:purple",
            label="engine queue (waiting)",
        )
        if any(s.proxy_queued is not None for s in samples):
            queue.plot(
                [s.t for s in samples],
                [s.proxy_queued or 0 for s in samples],
                color="tab:orange",
                label="shim queue",
            )
        queue.plot(
            [s.t for s in samples],
            [s.engine_running or 0 for s in samples],
            color="tab:grey",
            linewidth=0.8,
            label="engine running",
        )
        queue.set_ylabel("requests", fontsize=9)
        rejected = [a.answered for c in result.calls for a in c.attempts if a.rejected and a.answered]
        retries = [a.sent for c in result.calls for a in c.attempts[1:]]
        x, y = _counts([t for t in rejected if t is not None], end)
        rej.bar(x, y, width=BIN, align="edge", color="tab:red", alpha=0.6, label="429/503 per s")
        x, y = _counts(retries, end)
        rej.step(x, y, where="post", color="black", linewidth=1, label="retries sent per s")
        rej.set_ylabel("per second", fontsize=9)
        if row == 0:
            lat.set_title("latency: TTFT of each call (x = start)", fontsize=10)
            queue.set_title("queue depth over time", fontsize=10)
            rej.set_title("rejections and retries over time", fontsize=10)
        for ax in (lat, queue, rej):
            ax.legend(fontsize=7, loc="upper right")
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the run started")
    for col in range(3):
        top = max(ax.get_ylim()[1] for ax in axes[:, col])
        for ax in axes[:, col]:
            ax.set_ylim(0, top)
    fig.suptitle("\n".join(textwrap.wrap(title, width=170)), fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
