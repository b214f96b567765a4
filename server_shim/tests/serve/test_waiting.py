"""The asyncio edge of admission: futures, deadlines and cancellation races."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Outcome, Rejection
from llm_backoff_shim.serve.request_path.waiting import AsyncAdmission, Grant
from llm_backoff_shim.testing import ManualClock

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller
Make = Callable[..., AsyncAdmission]


@pytest.fixture(scope="module")
def make(make_controller: MakeController) -> Make:
    def build(limit: int = 1, max_queue: int = 5, max_wait: float = 30.0) -> AsyncAdmission:
        controller, clock = make_controller(limit, max_queue=max_queue, max_wait=max_wait, start=10.0)
        return AsyncAdmission(controller, clock)

    return build


def grant(result: Grant | Rejection) -> Grant:
    assert isinstance(result, Grant), result
    return result


REQ = AdmissionRequest("interactive")


async def test_queued_request_gets_the_slot_on_release(make: Make) -> None:
    admission = make()
    first = grant(await admission.acquire(REQ))
    waiting = asyncio.create_task(admission.acquire(REQ))
    await asyncio.sleep(0)
    assert admission.waiting == 1
    admission.release(first, Outcome.COMPLETED)
    second = grant(await waiting)
    assert admission.controller.in_flight() == 1
    admission.release(second, Outcome.COMPLETED)
    admission.release(second, Outcome.COMPLETED)  # a second release is a no-op
    assert (admission.controller.in_flight(), admission.waiting) == (0, 0)


async def test_cancelled_waiter_leaves_the_queue(make: Make) -> None:
    admission = make()
    first = grant(await admission.acquire(REQ))
    waiting = asyncio.create_task(admission.acquire(REQ))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert (admission.controller.queued(), admission.waiting) == (0, 0)
    admission.release(first, Outcome.COMPLETED)
    assert admission.controller.in_flight() == 0


async def test_cancel_after_grant_but_before_resuming_gives_the_slot_back(make: Make) -> None:
    admission = make()
    first = grant(await admission.acquire(REQ))
    waiting = asyncio.create_task(admission.acquire(REQ))
    await asyncio.sleep(0)
    admission.release(first, Outcome.COMPLETED)  # resolves the waiter's future...
    waiting.cancel()  # ...but its task is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert (admission.controller.in_flight(), admission.controller.queued()) == (0, 0)


async def test_deadline_turns_a_waiter_into_a_queue_timeout(make: Make) -> None:
    admission = make(max_wait=0.02)
    first = grant(await admission.acquire(REQ))
    result = await admission.acquire(REQ)
    assert isinstance(result, Rejection)
    assert result.code == "queue_timeout"
    assert (admission.controller.queued(), admission.waiting) == (0, 0)
    admission.release(first, Outcome.COMPLETED)


async def test_rejection_when_queue_full_is_returned_without_waiting(make: Make) -> None:
    admission = make(max_queue=0)
    first = grant(await admission.acquire(REQ))
    result = await admission.acquire(REQ)
    assert isinstance(result, Rejection)
    assert result.code == "queue_full"
    admission.release(first, Outcome.ABORTED)
    assert admission.controller.in_flight() == 0
