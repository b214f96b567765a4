"""Calibrate's view of the engine's own queue (pure): the gauges parsed, a window's medians."""

from __future__ import annotations

import asyncio

from llm_backoff_shim.lab.calibrate.run import EngineGauges, parse_gauges, window_medians

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 8.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0
"""


def test_the_gauges_are_summed_over_label_sets_and_absent_ones_say_so() -> None:
    assert parse_gauges(METRICS) == (3.0, 10.0)
    assert parse_gauges("vllm:num_requests_waiting 0\n") == (0.0, None)
    assert parse_gauges("process_cpu_seconds_total 1.0\n") is None
    assert parse_gauges("") is None


def test_a_windows_medians_count_only_the_reads_inside_it() -> None:
    reads = [(0.5, 9.0, 8.0), (1.0, 0.0, 8.0), (1.2, 1.0, 8.0), (1.4, 0.0, 7.0), (2.5, 5.0, None)]
    # (1.0, 2.0]: 1.2 and 1.4 (1.0 belongs to the window before)
    assert window_medians(reads, 1.0, 2.0) == (0.5, 7.5)
    assert window_medians(reads, 0.0, 1.5) == (0.5, 8.0)
    assert window_medians(reads, 2.0, 3.0) == (5.0, None)
    assert window_medians(reads, 3.0, 4.0) == (None, None)


def test_gauges_keep_reading_until_closed_and_an_engine_without_them_is_not_read() -> None:
    async def scenario() -> tuple[bool, int, bool, int]:
        texts = iter(["vllm:num_requests_waiting 2\nvllm:num_requests_running 8\n", None] * 1000)
        now = [0.0]

        async def fetch() -> str | None:
            now[0] += 0.1
            return next(texts)

        gauges = EngineGauges(fetch, lambda: now[0], interval=0.001)
        started = await gauges.start()
        await asyncio.sleep(0.05)
        await gauges.close()
        read = len(gauges.readings)

        async def nothing() -> str | None:
            return "other_metric 1\n"

        silent = EngineGauges(nothing, lambda: 0.0, interval=0.001)
        return started, read, await silent.start(), len(silent.readings)

    started, read, silent_started, silent_read = asyncio.run(scenario())
    assert started
    assert read >= 2  # the first read, then the loop's (the failed reads are gaps)
    assert not silent_started
    assert silent_read == 0
