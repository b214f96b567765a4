"""The benchmark's PNG: a panel per headline figure (median bar, a dot per seed), and the
engine's running requests against the callers alive over one seed's runs."""

from __future__ import annotations

import bisect
import textwrap
from collections.abc import Sequence
from pathlib import Path

from llm_backoff_shim.lab.load_records import RunResult

from .measures import COLUMNS, Cell, median

PANELS = (
    "interactive_within_budget",
    "batch_served",
    "useful_of_full_load",
    "failed_fast_share",
    "wasted_share",
    "idle_share",
)
COLOURS = ("tab:grey", "tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:red")


def save(
    labels: Sequence[str],
    cells: Sequence[Cell],
    timeline: Sequence[RunResult],
    slots: int,
    path: Path,
    title: str,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {attr: title for attr, title, _k in COLUMNS}
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    flat = list(axes.flat)
    for ax, attr in zip(flat, PANELS, strict=False):
        for x, label in enumerate(labels):
            values = [getattr(c, attr) for c in cells if c.label == label and getattr(c, attr) is not None]
            mid = median(values)
            colour = COLOURS[x % len(COLOURS)]
            if mid is not None:
                ax.bar(x, mid, color=colour, alpha=0.6)
            ax.scatter([x] * len(values), values, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(labels)))
        # Wrapped so that five or six configurations' names do not run into each other.
        ax.set_xticklabels([textwrap.fill(label, 16) for label in labels], fontsize=7)
        ax.set_title(titles[attr], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    busy = flat[len(PANELS)]
    waiting = flat[len(PANELS) + 1]
    for x, result in enumerate(timeline):
        colour = COLOURS[x % len(COLOURS)]
        samples = [s for s in result.samples if s.engine_running is not None]
        busy.plot([s.t for s in samples], [s.engine_running for s in samples], color=colour, linewidth=1)
        starts = sorted(c.start for c in result.calls)
        ends = sorted(c.end for c in result.calls if c.end is not None)
        alive = [bisect.bisect_right(starts, s.t) - bisect.bisect_right(ends, s.t) for s in samples]
        waiting.plot(
            [s.t for s in samples],
            [a - (s.engine_running or 0) for a, s in zip(alive, samples, strict=True)],
            color=colour,
            linewidth=1,
            label=result.setup.label,
        )
    busy.axhline(slots, color="black", linestyle="--", linewidth=0.8)
    busy.set_title(f"vLLM running requests (of {slots} slots), first seed", fontsize=10)
    waiting.set_title("callers alive and not running in vLLM, first seed", fontsize=10)
    waiting.legend(fontsize=7)
    for ax in (busy, waiting):
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    fig.suptitle("\n".join(textwrap.wrap(title, 200)), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
