"""The SDK alone under the simulator's faults: no hang past the deadline, no duplicated
output, no retry once a stream has begun.

Wrapped openai clients call the faulty simulator directly (no shim to smooth anything),
hundreds of calls, plain and streaming, with a 3 s deadline each. Needs the simulator
from ``llm-backoff-shim``; skipped where that is not installed (the openai 2.x env).
"""

from __future__ import annotations

import pytest

soak = pytest.importorskip("llm_backoff_shim.soak")


@pytest.mark.timeout(120)
def test_sdk_under_faults_never_hangs_duplicates_or_retries_a_started_stream() -> None:
    config = soak.SoakConfig(
        requests=600,
        seconds=30.0,
        warmup=30,
        seed=5,
        kinds=(("sdk", 0.5), ("sdk_stream", 0.5)),
        through_shim=False,
        error_rate=0.1,
        reset_rate=0.05,
        slow_first_byte_rate=0.05,
        stream_cut_rate=0.2,
    )
    report = soak.run_soak(config)
    assert report.requests > 0
    assert report.hangs == 0
    assert report.late == 0
    assert report.untyped == []
    assert report.duplicate_streams == 0
    assert report.retries_after_stream_start == 0
    assert report.outcomes["ok"] > 0
    # The faults were there, and the SDK hid what it could: a 500 or a reset before any byte
    # is retried, so most calls succeed; a stream cut after its start surfaces as an error.
    assert report.faults["errors"] > 0
    assert report.faults["resets"] > 0
    assert report.faults["stream_cuts"] > 0
    cut = sum(n for name, n in report.outcomes.items() if name.startswith(("error:", "sdk_error:")))
    assert cut > 0
    assert report.leaks() == []
