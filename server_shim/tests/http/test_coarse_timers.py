"""CoarseTimers and MoveOnAfter on them: the request path's cheap time limit (fires, absorbs only
its own cancellation)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from llm_backoff_shim.http.coarse_timers import CoarseTimers, MoveOnAfter


async def test_block_that_outlives_the_limit_is_cut_and_execution_continues() -> None:
    reached_end_of_block = False
    with MoveOnAfter(CoarseTimers(0.01)) as limit:
        await asyncio.sleep(30)
        reached_end_of_block = True
    assert limit.expired
    assert not reached_end_of_block
    await asyncio.sleep(0)  # no cancellation left pending on the task
    if sys.version_info >= (3, 11):
        task = asyncio.current_task()
        assert task is not None
        assert task.cancelling() == 0


async def test_block_within_the_limit_is_untouched() -> None:
    timers = CoarseTimers(30)
    with MoveOnAfter(timers) as limit:
        await asyncio.sleep(0)
        assert len(timers) == 1
        value = 42
    assert value == 42
    assert not limit.expired
    assert len(timers) == 0  # its timeout was discarded: nothing fires later


async def test_timeouts_fire_in_order_and_discarded_ones_never() -> None:
    timers = CoarseTimers(0.01)
    fired: list[str] = []
    timers.add(lambda: fired.append("a"))
    key = timers.add(lambda: fired.append("b"))
    timers.add(lambda: fired.append("c"))
    timers.discard(key)
    while len(timers):  # noqa: ASYNC110 - the loop's own timer drains them
        await asyncio.sleep(0.005)
    assert fired == ["a", "c"]


def test_delay_must_be_positive() -> None:
    with pytest.raises(ValueError, match="delay"):
        CoarseTimers(0)


async def test_none_means_no_limit() -> None:
    with MoveOnAfter(None) as limit:
        await asyncio.sleep(0.01)
    assert not limit.expired


async def test_exceptions_from_the_block_pass_through() -> None:
    with pytest.raises(KeyError), MoveOnAfter(CoarseTimers(30)):
        raise KeyError("x")


async def test_cancellation_from_elsewhere_is_not_absorbed() -> None:
    entered = asyncio.Event()
    after_block = False

    async def victim() -> None:
        nonlocal after_block
        with MoveOnAfter(CoarseTimers(30)):
            entered.set()
            await asyncio.sleep(30)
        after_block = True

    task = asyncio.create_task(victim())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not after_block


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 cannot tell two cancellations apart")
async def test_outside_cancel_arriving_with_the_expiry_still_propagates() -> None:
    limit = MoveOnAfter(CoarseTimers(0.01))
    after_block = False

    async def victim() -> None:
        nonlocal after_block
        with limit:
            await asyncio.sleep(30)
        after_block = True

    task = asyncio.create_task(victim())
    # Polling, not an Event: the outside cancel must land before the victim runs again.
    while not limit.expired:  # noqa: ASYNC110
        await asyncio.sleep(0)
    # The limit has cancelled the victim, which has not run since: cancel it from outside too.
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not after_block


async def test_needs_a_task() -> None:
    loop = asyncio.get_running_loop()
    error: list[BaseException] = []

    def outside_any_task() -> None:
        try:
            MoveOnAfter(CoarseTimers(1)).__enter__()
        except RuntimeError as exc:
            error.append(exc)

    loop.call_soon(outside_any_task)
    await asyncio.sleep(0.01)
    assert error
    assert "task" in str(error[0])
