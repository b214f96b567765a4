"""Confidence earned across runs: calibrate keeps each run's recommendation in
``--out`` and compares the next run on the same engine with it.

One run's own repeats cannot tell whether a second run would say the same: on an engine whose
levels next to the knee are within a few percent of each other, the machine's noise picks
one, and every repeat of the run agrees with itself (measured: 12 and 8 in flight on one
engine, both "high"). So ``high`` needs two runs: each run appends a line to ``DIR/calibrate-runs.jsonl``
(:data:`HISTORY_NAME`) and is compared with the latest earlier run against the same upstream,
model, SLOs and mix (:func:`same_setup`):

- the two recommended ``--max-concurrency`` within :data:`~.measure.REPRODUCIBLE`
  (15 %) of each other, the interactive queue waits within 15 %, and the cost budgets
  (``--max-inflight-tokens``) within 15 % when both runs recommended one: ``high`` (``medium``
  when this run's own repeats were still ``low``);
- further apart: ``low``, naming the earlier value;
- no earlier run: at most ``medium``, saying how to confirm.

:func:`across_runs` is pure; :func:`load` and :func:`append` are the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .measure import REPRODUCIBLE, Confidence

#: The runs' file in ``--out``: one JSON object per line, oldest first.
HISTORY_NAME = "calibrate-runs.jsonl"


@dataclass(frozen=True)
class RunRecord:
    """What one run recommended, and what it was run against."""

    at: str
    upstream: str
    model: str
    ttft_slo: float
    tpot_slo: float | None
    mix: str
    max_concurrency: int
    max_queue_wait: float
    knee_tokens_per_s: float
    #: The recommended ``--max-inflight-tokens`` (None: none measured, or a run kept before the
    #: file had it).
    max_inflight_tokens: int | None = None


_FIELDS = frozenset(RunRecord.__dataclass_fields__)


def same_setup(a: RunRecord, b: RunRecord) -> bool:
    """The two runs measured the same thing: upstream, model, SLOs and mix."""
    return (a.upstream, a.model, a.ttft_slo, a.tpot_slo, a.mix) == (
        b.upstream,
        b.model,
        b.ttft_slo,
        b.tpot_slo,
        b.mix,
    )


def within(a: float, b: float) -> bool:
    """``a`` and ``b`` within :data:`REPRODUCIBLE` of the larger."""
    return abs(a - b) <= REPRODUCIBLE * max(a, b) + 1e-9


def agree(a: RunRecord, b: RunRecord) -> bool:
    """Two runs' recommendations agree: concurrency, interactive queue wait and cost budget (when
    both have one) each within 15 %."""
    budgets = a.max_inflight_tokens is None or b.max_inflight_tokens is None
    return (
        within(a.max_concurrency, b.max_concurrency)
        and within(a.max_queue_wait, b.max_queue_wait)
        and (budgets or within(a.max_inflight_tokens or 0, b.max_inflight_tokens or 0))
    )


def describe(run: RunRecord) -> str:
    """The flags two runs are compared on."""
    text = f"--max-concurrency {run.max_concurrency}, --max-queue-wait {run.max_queue_wait:g}"
    if run.max_inflight_tokens is not None:
        text += f", --max-inflight-tokens {run.max_inflight_tokens}"
    return text


def previous(records: Sequence[RunRecord], current: RunRecord) -> RunRecord | None:
    """The latest earlier run of the same setup."""
    return next((r for r in reversed(records) if same_setup(r, current)), None)


def across_runs(
    own: Confidence, own_reason: str, current: RunRecord, earlier: RunRecord | None, where: str
) -> tuple[Confidence, str]:
    """The confidence line: this run's own (``own``, ``own_reason``) judged against ``earlier``."""
    mine = describe(current)
    if earlier is None:
        level: Confidence = "low" if own == "low" else "medium"
        return level, (
            f"first run of this setup in {where}; run calibrate again with the same --out: 'high' "
            f"needs two runs within {REPRODUCIBLE:.0%} of each other (this run: {own}, {own_reason})"
        )
    theirs = describe(earlier)
    if agree(current, earlier):
        level = "medium" if own == "low" else "high"
        return level, (
            f"the run of {earlier.at} recommended {theirs}, this one {mine}: within "
            f"{REPRODUCIBLE:.0%} (this run: {own}, {own_reason})"
        )
    return "low", (
        f"the run of {earlier.at} recommended {theirs}, this one {mine}: more than {REPRODUCIBLE:.0%} "
        "apart on the same setup; run again and use the lower values two runs agree on"
    )


def load(path: Path) -> list[RunRecord]:
    """The runs kept in ``path`` (none when it cannot be read); lines that do not parse are
    skipped (a torn write), and keys this version does not keep are ignored (an older one's)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    records = []
    for line in text.splitlines():
        try:
            fields = json.loads(line)
            records.append(RunRecord(**{k: v for k, v in fields.items() if k in _FIELDS}))
        except (ValueError, TypeError, AttributeError):
            continue
    return records


def append(path: Path, record: RunRecord) -> None:
    """Add ``record`` to ``path`` (created with its directory); ``OSError`` if it cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(record)) + "\n")
