from __future__ import annotations

import asyncio
import threading

import pytest

from llm_backoff.testing import current_mode, instant_retries


def test_mode_is_scoped_to_the_block() -> None:
    assert current_mode() is None
    with instant_retries(max_attempts=2) as mode:
        assert current_mode() is mode
        assert mode.max_attempts == 2
        with instant_retries() as inner:
            assert current_mode() is inner
        assert current_mode() is mode
    assert current_mode() is None


def test_mode_is_undone_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), instant_retries():
        raise RuntimeError
    assert current_mode() is None


def test_invalid_cap() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        instant_retries(max_attempts=0).__enter__()


def test_does_not_leak_into_other_threads() -> None:
    seen: list[object] = []
    with instant_retries():
        t = threading.Thread(target=lambda: seen.append(current_mode()))
        t.start()
        t.join()
    assert seen == [None]


async def test_flows_into_tasks_created_inside_only() -> None:
    async def probe() -> object:
        return current_mode()

    with instant_retries() as mode:
        inside = asyncio.create_task(probe())
    outside = asyncio.create_task(probe())
    assert await inside is mode
    assert await outside is None
