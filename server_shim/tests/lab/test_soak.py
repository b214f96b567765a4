"""CI-sized soak with faults: thousands of requests through the shim to a faulty simulator.

Bounded in count (2000 requests) and in time (new requests stop after 40 s, whatever the
machine's speed); every call has a watchdog (its deadline plus a grace) that only
catches hangs. Afterwards nothing may be lost or leaked. The longer opt-in run is
``python bench/soak.py``; the figures of the longer run are in docs/benchmarks.md.
"""

from __future__ import annotations

import json

import pytest

from llm_backoff_shim.lab.soak import KINDS, SoakConfig, SoakReport, run_soak

#: Stated bound on resident-memory growth of the process (sim + shim + clients) over the
#: CI soak, measured after a warm-up. Observed: a few MiB. A per-request leak of even
#: 16 KiB would exceed it.
MAX_RSS_GROWTH_MIB = 32.0


@pytest.fixture(scope="module")
def report() -> SoakReport:
    result = run_soak(SoakConfig(requests=2000, seconds=40.0, warmup=150, seed=11))
    print(json.dumps(result.summary(), indent=1))  # shown with -s; docs/reliability.md says what is judged
    return result


@pytest.mark.timeout(180)
def test_every_call_ended_in_success_or_a_typed_error_in_time(report: SoakReport) -> None:
    assert report.requests > 0
    assert set(report.by_kind) == set(KINDS)  # every kind of client took part
    assert report.hangs == 0
    assert report.late == 0
    assert report.untyped == []
    assert report.outcomes["ok"] > 0
    # Every outcome is one of the typed kinds the driver knows.
    allowed_prefixes = ("ok", "client_left", "status:", "error:", "sdk_status:", "sdk_error:")
    assert all(name.startswith(allowed_prefixes) for name in report.outcomes), report.outcomes
    assert sum(report.outcomes.values()) == report.requests


@pytest.mark.timeout(180)
def test_faults_of_every_kind_were_injected_and_clients_left(report: SoakReport) -> None:
    for kind in ("errors", "resets", "slow_first_byte", "stream_cuts"):
        assert report.faults[kind] > 0, kind
    assert report.outcomes["client_left"] > 0
    assert report.outcomes["client_left_stream"] > 0
    assert report.shim_counts.get("client_disconnected", 0) > 0


@pytest.mark.timeout(180)
def test_streams_never_duplicate_and_sdk_never_retries_a_started_stream(report: SoakReport) -> None:
    assert report.duplicate_streams == 0
    assert report.retries_after_stream_start == 0


@pytest.mark.timeout(180)
def test_shim_rejections_carry_retry_after(report: SoakReport) -> None:
    assert report.shim_errors_without_retry_after == 0
    assert (
        report.shim_counts.get("rejected:queue_full", 0) + report.shim_counts.get("rejected:queue_timeout", 0)
        > 0
    )


@pytest.mark.timeout(180)
def test_nothing_leaked(report: SoakReport) -> None:
    assert report.leaks() == [], report.summary()
    assert set(report.gauges_after.values()) == {0.0}
    assert report.waiting_futures_after == 0
    # Well-formed clients are never taken for hostile ones.
    assert report.bad_requests == {}, report.bad_requests
    assert report.baseline is not None
    assert report.after is not None
    assert report.after.connections_shim == report.after.connections_sim == 0
    assert report.after.rss_mib - report.baseline.rss_mib <= MAX_RSS_GROWTH_MIB, report.summary()
