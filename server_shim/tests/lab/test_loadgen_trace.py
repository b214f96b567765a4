"""The load generator stamps each attempt at the wire: written when the request's head goes out."""

from __future__ import annotations

import asyncio
import itertools
import sys
from typing import Any

import openai
import pytest

from llm_backoff_shim.lab.attempt_capture import CountingTransport, bind_call, http_library
from llm_backoff_shim.lab.load_records import AttemptRecord, CallRecord
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app


def test_attempts_are_stamped_at_the_write_and_the_read_and_a_chained_trace_still_runs() -> None:
    http = http_library()
    ticks = itertools.count()
    events: list[str] = []

    async def chained(event: str, info: dict[str, Any]) -> None:
        events.append(event)

    async def run(url: str) -> CallRecord:
        transport = CountingTransport(http.AsyncHTTPTransport(), lambda: float(next(ticks)), http.ByteStream)
        record = CallRecord(3, "interactive", 0.0, 5.0)
        async with http.AsyncClient(transport=transport) as client:

            async def call() -> None:
                bind_call(record)
                response = await client.get(url + "/v1/models", extensions={"trace": chained})
                assert response.status_code == 200

            await asyncio.create_task(call())
        return record

    with ServerThread(create_sim_app(SimConfig())) as sim:
        record = asyncio.run(run(sim.url))
    (attempt,) = record.attempts
    assert attempt.written is not None
    assert attempt.answered is not None
    # Entering the transport, taking a connection, writing, reading: in that order.
    assert attempt.sent < attempt.written < attempt.answered
    assert attempt.latency_from_head == attempt.answered - attempt.written
    # Even a GET's (empty) body is sent as its own step: the latency runs from there.
    assert attempt.body_sent is not None
    assert attempt.written < attempt.body_sent < attempt.answered
    assert attempt.latency == attempt.answered - attempt.body_sent
    assert any(e.endswith("send_request_headers.started") for e in events)
    assert any(e.endswith("receive_response_headers.complete") for e in events)


def test_latency_falls_back_to_the_send_when_the_write_was_not_traced() -> None:
    assert AttemptRecord(1, sent=1.0, answered=1.5).latency == 0.5
    assert AttemptRecord(1, sent=1.0, answered=1.5, written=1.25).latency == 0.25
    assert AttemptRecord(1, sent=1.0).latency is None


def test_latency_runs_from_the_last_byte_and_from_the_head_beside_it() -> None:
    # Head written at 1.25, body (the last byte) at 1.375, answer read at 1.5.
    record = AttemptRecord(1, sent=1.0, answered=1.5, written=1.25, body_sent=1.375)
    assert record.latency == 0.125
    assert record.latency_from_head == 0.25
    assert AttemptRecord(1, sent=1.0, written=1.25, body_sent=1.375).latency is None


def test_openai_attempts_through_the_transport_are_traced() -> None:
    http = http_library()

    async def run(url: str) -> CallRecord:
        transport = CountingTransport(http.AsyncHTTPTransport(), lambda: 0.0, http.ByteStream)
        record = CallRecord(4, "interactive", 0.0, 5.0)
        async with http.AsyncClient(transport=transport) as shared:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", http_client=shared, max_retries=0)

            async def call() -> None:
                bind_call(record)
                await client.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=1
                )

            await asyncio.create_task(call())
        return record

    with ServerThread(create_sim_app(SimConfig(ttft=0.0, itl=0.0, output_tokens=1))) as sim:
        record = asyncio.run(run(sim.url))
    (attempt,) = record.attempts
    assert attempt.status == 200
    assert attempt.written is not None
    # A POST has a body: its last byte is stamped after the head went out.
    assert attempt.body_sent is not None
    assert attempt.written <= attempt.body_sent


def test_a_request_sent_again_stamps_only_its_own_attempt() -> None:
    # Retry loops may send the same request object twice; the first attempt's record must
    # keep its own times, not take the second attempt's.
    http = http_library()
    ticks = itertools.count()

    async def run(url: str) -> CallRecord:
        transport = CountingTransport(http.AsyncHTTPTransport(), lambda: float(next(ticks)), http.ByteStream)
        record = CallRecord(5, "interactive", 0.0, 5.0)
        async with http.AsyncClient(transport=transport) as client:

            async def call() -> None:
                bind_call(record)
                request = client.build_request("GET", url + "/v1/models")
                for _ in range(2):
                    response = await client.send(request)
                    await response.aclose()

            await asyncio.create_task(call())
        return record

    with ServerThread(create_sim_app(SimConfig())) as sim:
        record = asyncio.run(run(sim.url))
    first, second = record.attempts
    assert first.answered is not None
    assert second.written is not None
    assert first.answered < second.sent < second.written


async def test_a_call_is_cut_at_its_deadline_in_its_own_task() -> None:
    from llm_backoff_shim.lab.loadgen import _within

    outer = asyncio.current_task()
    tasks: list[asyncio.Task[Any] | None] = []

    async def call(wait: float) -> None:
        tasks.append(asyncio.current_task())
        await asyncio.sleep(wait)

    await _within(call(0.0), 5.0)
    with pytest.raises(asyncio.TimeoutError):
        await _within(call(5.0), 0.01)
    # The same task: no second task to be scheduled behind the others while the deadline
    # runs (Python 3.10 has no asyncio.timeout and falls back to wait_for).
    if sys.version_info >= (3, 11):
        assert tasks == [outer, outer]
