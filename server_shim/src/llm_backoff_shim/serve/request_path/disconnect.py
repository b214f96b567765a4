"""Run a request's work in its own task, cancelled the moment its client disconnects."""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from llm_backoff_shim.http.interface import ConnectionGone
from llm_backoff_shim.serve.request_path.exchange import Receive


async def watch_disconnect(
    task: asyncio.Task[Any],
    receive: Receive,
    work: Callable[[], Awaitable[None]],
    gone: ConnectionGone | None = None,
) -> bool:
    """Run ``work`` in ``task`` (the current one); cancel it if the client disconnects first.

    Returns True when the client disconnected.

    With the serving protocol's :class:`ConnectionGone` signal (``gone``) the request's
    task is cancelled from the protocol's ``connection_lost``; without it, a watcher task
    waits on ``receive()``.

    After the request body is read, ``receive()`` only ever returns ``http.disconnect``
    (uvicorn also returns it once the response is complete, hence the ``done`` flag).

    Plain asyncio rather than an anyio task group: this runs for every request, and on
    the benchmark machines a task group (task handle, cancel scopes, backend lookup)
    cost about as much CPU as the whole relay (bench/bench_proxy.py). The watcher
    cancels the request's own task; that cancellation is absorbed here, and one that
    came from elsewhere (server shutdown) still propagates.
    """
    done = False
    disconnected = False

    def on_disconnect() -> None:
        nonlocal disconnected
        if not done:
            disconnected = True
            task.cancel()

    stop: Callable[[], object]
    if gone is not None:
        gone.subscribe(on_disconnect)
        stop = functools.partial(gone.unsubscribe, on_disconnect)
    else:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            on_disconnect()

        stop = task.get_loop().create_task(watch()).cancel
    try:
        await work()
    except asyncio.CancelledError:
        if not disconnected or _still_cancelling(task):
            raise
    finally:
        done = True
        stop()
    return disconnected


def _still_cancelling(task: asyncio.Task[Any]) -> bool:
    """After absorbing our own cancel: whether another cancellation is pending (Python >= 3.11)."""
    if sys.version_info >= (3, 11):
        return task.uncancel() > 0
    return False  # 3.10 cannot tell; a shutdown cancel arriving in the same instant is absorbed
