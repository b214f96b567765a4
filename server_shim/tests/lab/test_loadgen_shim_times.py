"""The shim's own time for each attempt, matched from its access log next to the client's figure."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest

from llm_backoff_shim.lab.attempt_capture import CountingTransport, bind_call, http_library
from llm_backoff_shim.lab.figures import figures
from llm_backoff_shim.lab.load_records import (
    AttemptRecord,
    CallRecord,
    RunResult,
    attach_shim_times,
    attempt_id,
)
from llm_backoff_shim.lab.loadgen import LoadRun
from llm_backoff_shim.lab.report import comparison, table
from llm_backoff_shim.lab.scenario import SHIM_PLAIN, Scenario, arrivals
from llm_backoff_shim.serve.app import create_app
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.log_setup import LOGGER_NAME
from llm_backoff_shim.serve.serving import ServerThread, shim_server
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

SCENARIO = Scenario("t", burst=4, rate_factor=0, duration=0, deadline=5.0, ttft_budget=5.0)


def _result(calls: list[CallRecord]) -> RunResult:
    return RunResult(SHIM_PLAIN, SCENARIO, 1.0, calls, [], {}, 1.0)


def test_access_log_lines_are_matched_to_attempts_by_request_id() -> None:
    first = CallRecord(0, "interactive", 0.0, 5.0)
    first.attempts = [
        AttemptRecord(1, 0.0, 0.400, 429, code="queue_full"),
        AttemptRecord(2, 1.0, 1.010, 200),
    ]
    second = CallRecord(1, "batch", 0.0, 5.0)
    second.attempts = [AttemptRecord(1, 0.0, 0.900, 429, code="queue_full")]
    log = "\n".join(
        [
            "INFO:     Uvicorn running on http://127.0.0.1:1",  # not an access line
            json.dumps({"request_id": attempt_id(0, 1), "status": 429, "total_ms": 2.5}),
            json.dumps({"request_id": attempt_id(0, 2), "status": 200, "total_ms": 1004.0}),
            json.dumps({"request_id": attempt_id(1, 1), "status": 429, "total_ms": 3.5}),
            json.dumps({"request_id": None, "status": 200, "total_ms": 1.0}),
            json.dumps({"request_id": "7-1", "status": 429, "total_ms": 9.0}),  # a call not in this run
            '{"request_id": "0-1", broken',
        ]
    )
    assert attach_shim_times([first, second], log) == 3
    assert [a.shim_seconds for a in first.attempts] == pytest.approx([0.0025, 1.004])
    f = figures(_result([first, second]))
    # Caller-side: the client's own lag is in it; inside the shim: only the shim's work.
    assert f.rejection_p99 == pytest.approx(0.9)
    assert f.shim_rejection_p50 == pytest.approx(0.0025)
    assert f.shim_rejection_p99 == pytest.approx(0.0035)
    assert f.shim_rejections_matched == 2
    assert "same, inside the shim" in table(f)
    assert "same, inside the shim" in comparison([f])
    # Without body_ms (answered from the head, or logged before body_ms was): no figure after
    # the body, and counted as answered from the head.
    assert f.shim_rejection_after_body_p99 is None
    assert f.shim_refused_from_head == 2
    assert "2 answered from its head" in table(f)


def test_the_shims_time_after_the_body_leaves_out_the_wait_for_it() -> None:
    call = CallRecord(0, "interactive", 0.0, 5.0)
    call.attempts = [AttemptRecord(1, 0.0, 0.030, 429, code="queue_full")]
    # 25 ms of the shim's 27 ms went waiting for the client's body.
    log = json.dumps({"request_id": attempt_id(0, 1), "status": 429, "total_ms": 27.0, "body_ms": 25.0})
    assert attach_shim_times([call], log) == 1
    f = figures(_result([call]))
    assert f.shim_rejection_p99 == pytest.approx(0.027)
    assert f.shim_rejection_after_body_p99 == pytest.approx(0.002)
    assert "after the request's body was read" in table(f)
    assert "inside the shim, after the body" in comparison([f])
    assert f.shim_refused_from_head == 0
    assert "answered from its head" not in table(f)


def test_without_an_access_log_the_shim_figures_stay_empty() -> None:
    call = CallRecord(0, "interactive", 0.0, 5.0)
    call.attempts = [AttemptRecord(1, 0.0, 0.4, 429, code="queue_full")]
    f = figures(_result([call]))
    assert (f.shim_rejection_p99, f.shim_rejections_matched) == (None, 0)
    assert "inside the shim" not in table(f)
    assert "inside the shim" not in comparison([f])


async def test_each_attempt_carries_its_own_request_id() -> None:
    if http_library() is not httpx2:
        pytest.skip("this openai version is not built on httpx2")
    seen: list[str] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.headers.get("x-request-id", ""))
        if len(seen) == 1:
            body = {"error": {"message": "full", "type": "server_overloaded", "code": "queue_full"}}
            return httpx2.Response(429, json=body, headers={"retry-after-ms": "1"})
        return httpx2.Response(
            200,
            json={
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                ],
            },
        )

    transport = CountingTransport(httpx2.MockTransport(handler), lambda: 0.0, httpx2.ByteStream)
    async with httpx2.AsyncClient(transport=transport) as http:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", http_client=http, max_retries=2)
        record = CallRecord(12, "interactive", 0.0, 5.0)

        async def call() -> None:
            bind_call(record)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])

        await asyncio.create_task(call())
    assert seen == ["12-1", "12-2"]


@pytest.fixture
def access_lines() -> Iterator[io.StringIO]:
    logger = logging.getLogger(LOGGER_NAME)
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    previous = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield buffer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]


def test_a_real_shims_access_log_times_its_rejections(access_lines: io.StringIO) -> None:
    scenario = Scenario("t", burst=4, rate_factor=0, duration=0, deadline=5.0, ttft_budget=5.0)
    config = SimConfig(max_num_seqs=1, ttft=0.02, itl=0.01, output_tokens=5, itl_batch_factor=0)
    with ServerThread(create_sim_app(config)) as sim:
        settings: Any = ShimSettings(
            upstream=sim.url,
            max_concurrency=1,
            max_queue=0,
            retry_after_min=0.05,
            retry_after_max=1.0,
            initial_service_time=0.1,
            log_format="json",
        )
        with shim_server(create_app(settings)) as shim:
            run = LoadRun(
                SHIM_PLAIN,
                scenario,
                arrivals(scenario, 1.0, random.Random(1)),
                target_url=shim.url,
                engine_url=sim.url,
                shim_url=shim.url,
                capacity=1.0,
            )
            result = asyncio.run(run.run())
    attempts = [a for c in result.calls for a in c.attempts]
    assert attach_shim_times(result.calls, access_lines.getvalue()) == len(attempts)
    f = figures(result)
    assert f.rejections >= 2  # one slot, no queue
    assert f.shim_rejections_matched == f.rejections
    assert f.shim_rejection_p99 is not None
    assert f.rejection_p99 is not None
