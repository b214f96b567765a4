"""The soak's leak audit: looking inside the shim and the simulator once the load is over.

Both servers run in this process, each in its own thread and event loop, so the audit
counts their asyncio tasks and open connections on their own loops (:func:`on_loop`),
and this process's file descriptors and resident memory; the shim's counters come from
its ``/metrics``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from llm_backoff_shim.lab.soak_report import Snapshot
from llm_backoff_shim.serve.app import ShimRuntime
from llm_backoff_shim.serve.serving import ServerThread


def rss_mib() -> float:
    """This process's resident memory in MiB (Linux ``/proc``); NaN where it is not reported."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def fd_count() -> int:
    """This process's open file descriptors (Linux ``/proc``)."""
    return len(os.listdir("/proc/self/fd"))


def on_loop(server: ServerThread, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on ``server``'s own event loop (its thread), waited for up to 10 s."""
    loop = server.loop
    assert loop is not None

    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(10)


def task_count(server: ServerThread) -> int:
    """The asyncio tasks alive on ``server``'s event loop."""
    # Minus one: the task that does the counting.
    return int(on_loop(server, lambda: len(asyncio.all_tasks()))) - 1


def settle(
    shim: ServerThread, sim: ServerThread, runtime: ShimRuntime, baseline: Snapshot | None, timeout: float
) -> Snapshot:
    """Wait (bounded) until the shim is idle and idle connections have closed; then measure."""
    end = time.monotonic() + timeout
    while True:
        gc.collect()
        idle = on_loop(shim, lambda: runtime.controller.in_flight() + runtime.controller.queued()) == 0
        snap = Snapshot(
            task_count(shim),
            task_count(sim),
            fd_count(),
            rss_mib(),
            on_loop(shim, lambda: len(shim.server.server_state.connections)),
            on_loop(sim, lambda: len(sim.server.server_state.connections)),
        )
        settled = idle and (
            baseline is None
            or (
                snap.tasks_shim <= baseline.tasks_shim
                and snap.tasks_sim <= baseline.tasks_sim
                and snap.fds <= baseline.fds
                and snap.connections_shim == 0
                and snap.connections_sim == 0
            )
        )
        if settled or time.monotonic() > end:
            return snap
        time.sleep(0.1)


def metric_values(url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics as {"name,label=value,...": value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def outcome_counts(values: dict[str, float]) -> dict[str, float]:
    """``llm_backoff_shim_requests_total`` as {"outcome" or "outcome:code": count}."""
    counts: Counter[str] = Counter()
    for key, value in values.items():
        if key.startswith("llm_backoff_shim_requests_total,"):
            labels = dict(part.split("=", 1) for part in key.split(",")[1:])
            name = labels["outcome"] + (f":{labels['code']}" if labels.get("code") else "")
            counts[name] += int(value)
    return dict(sorted(counts.items()))
