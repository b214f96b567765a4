"""The SDK alone under the simulator's faults: no hang past the deadline, no duplicated
output, no retry once a stream has begun.

Wrapped openai clients call the faulty simulator directly (no shim to smooth anything),
hundreds of calls, plain and streaming, with a 3 s deadline each. Needs the simulator
from ``llm-backoff-shim``; skipped where that is not installed (the openai 2.x env).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest


@pytest.mark.timeout(120)
def test_sdk_under_faults_never_hangs_duplicates_or_retries_a_started_stream() -> None:
    soak = pytest.importorskip("llm_backoff_shim.lab.soak")
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


def _drip_app(chunks: int, every: float) -> Any:
    """An OpenAI-ish server whose JSON answer trickles in: each read gets data in time."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def models(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for _ in range(chunks):
                yield b" "
                await asyncio.sleep(every)
            yield b'{"object": "list", "data": []}'

        return StreamingResponse(body(), media_type="application/json")

    return Starlette(routes=[Route("/v1/models", models)])


def test_a_dripping_body_cannot_stretch_a_sync_call_past_its_deadline(serve: Callable[[Any], str]) -> None:
    """Per-read timeouts alone would let 20 x 0.25 s of drip through a 1 s deadline."""
    import openai

    import llm_backoff

    url = serve(_drip_app(chunks=20, every=0.25))
    client = llm_backoff.wrap(
        openai.OpenAI(base_url=url + "/v1", api_key="k"),
        llm_backoff.RetryPolicy(deadline=1.0, max_attempts=1),
    )
    with pytest.raises(openai.APITimeoutError):
        client.models.list()


async def test_a_dripping_body_cannot_stretch_an_async_call_past_its_deadline(
    serve: Callable[[Any], str],
) -> None:
    import openai

    import llm_backoff

    url = serve(_drip_app(chunks=20, every=0.25))
    client = llm_backoff.wrap(
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="k"),
        llm_backoff.RetryPolicy(deadline=1.0, max_attempts=1),
    )
    with pytest.raises(openai.APITimeoutError):
        await client.models.list()
