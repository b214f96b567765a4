"""Confidence across runs (pure, the file aside): two runs of the same setup must agree."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from llm_backoff_shim.lab.calibrate.history import (
    RunRecord,
    across_runs,
    agree,
    append,
    load,
    previous,
    same_setup,
)

RUN = RunRecord(
    at="2026-12-07T02:17:34+00:00",
    upstream="http://127.0.0.1:8000",
    model="m",
    ttft_slo=1.0,
    tpot_slo=0.1,
    mix="prompt lognormal:40:0.9:5-200 words, output lognormal:64:0.8:1-512 tokens",
    max_concurrency=8,
    max_queue_wait=4.96,
    knee_tokens_per_s=1310.0,
)


def run(**changes: object) -> RunRecord:
    return dataclasses.replace(RUN, **changes)  # type: ignore[arg-type]


def test_a_first_run_is_at_most_medium_and_says_how_to_confirm() -> None:
    level, why = across_runs("high", "2 measurements of 8 agree", RUN, None, "out/calibrate-runs.jsonl")
    assert level == "medium"
    assert "first run of this setup in out/calibrate-runs.jsonl" in why
    assert "run calibrate again with the same --out" in why
    assert "this run: high, 2 measurements of 8 agree" in why
    assert across_runs("low", "it moved", RUN, None, "f")[0] == "low"


def test_two_runs_within_fifteen_percent_earn_high_and_further_apart_low() -> None:
    # The two runs: 12 and 8 on the same engine, each 'high' on its own.
    level, why = across_runs("high", "agree", run(max_concurrency=12, max_queue_wait=4.0), RUN, "f")
    assert level == "low"
    assert "recommended --max-concurrency 8, --max-queue-wait 4.96" in why
    assert "this one --max-concurrency 12" in why
    assert "more than 15% apart" in why
    level, why = across_runs("medium", "spread", run(max_queue_wait=4.5), RUN, "f")
    assert level == "high"
    assert "within 15%" in why
    # Its own verdict still counts: two runs agreeing on a knee that moved within one are medium.
    assert across_runs("low", "moved", RUN, RUN, "f")[0] == "medium"


def test_agreement_is_fifteen_percent_of_the_larger() -> None:
    assert agree(run(max_concurrency=16), run(max_concurrency=14))  # 12.5 %
    assert not agree(run(max_concurrency=16), run(max_concurrency=13))  # 19 %
    assert agree(run(max_queue_wait=4.96), run(max_queue_wait=4.3))  # 13.3 %
    assert not agree(run(max_queue_wait=4.96), run(max_queue_wait=4.0))  # 19 %


def test_the_cost_budgets_agree_too_when_both_runs_have_one() -> None:
    assert agree(run(max_inflight_tokens=9600), run(max_inflight_tokens=8832))  # 8 %
    assert not agree(run(max_inflight_tokens=9664), run(max_inflight_tokens=6464))  # 33 %
    assert agree(run(max_inflight_tokens=9664), run(max_inflight_tokens=None))
    level, why = across_runs(
        "high", "agree", run(max_inflight_tokens=6464), run(max_inflight_tokens=9664), "f"
    )
    assert level == "low"
    assert "recommended --max-concurrency 8, --max-queue-wait 4.96, --max-inflight-tokens 9664" in why
    assert "use the lower values two runs agree on" in why


def test_only_a_run_of_the_same_setup_is_compared_and_the_latest_one() -> None:
    older = run(at="1", max_concurrency=4)
    other = run(at="2", upstream="http://other:8000")
    latest = run(at="3", max_concurrency=9)
    assert previous([older, latest, other], RUN) == latest
    assert previous([other], RUN) is None
    assert same_setup(RUN, run(at="x", max_concurrency=99, knee_tokens_per_s=1.0))
    for change in ({"model": "n"}, {"ttft_slo": 2.0}, {"tpot_slo": None}, {"mix": "prompt 10 words"}):
        assert not same_setup(RUN, run(**change))


def test_the_file_keeps_every_run_and_skips_what_does_not_parse(tmp_path: Path) -> None:
    path = tmp_path / "out" / "calibrate-runs.jsonl"
    assert load(path) == []
    append(path, RUN)
    with path.open("a") as f:
        f.write('not json\n{"at": 1}\n')
    append(path, run(max_concurrency=9))
    assert [r.max_concurrency for r in load(path)] == [8, 9]
    # A run kept before the budget was: read without one.
    older = {k: v for k, v in dataclasses.asdict(RUN).items() if k != "max_inflight_tokens"}
    with path.open("a") as f:
        f.write(json.dumps(older) + "\n")
    assert load(path)[-1] == RUN
    # A run kept by an older version, with the queue bound it then recommended: read without it.
    with path.open("a") as f:
        f.write(json.dumps({**dataclasses.asdict(RUN), "max_queue": 80}) + "\n[1]\n")
    assert load(path)[-1] == RUN
    assert load(tmp_path) == []  # a directory: nothing to read, not an error
