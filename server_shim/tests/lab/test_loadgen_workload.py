"""Realistic workloads: length distributions, per-class budgets, useful tokens, engines without /sim."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from llm_backoff_shim.lab.figures import figures
from llm_backoff_shim.lab.load_records import CallRecord, RunResult
from llm_backoff_shim.lab.loadgen import LoadRun
from llm_backoff_shim.lab.loadgen_engine import EngineProbe, metric_sum
from llm_backoff_shim.lab.report import comparison, table
from llm_backoff_shim.lab.scenario import (
    DIRECT_PLAIN,
    SHIM_PLAIN,
    Arrival,
    EngineShape,
    Scenario,
    arrivals,
    profile_demo_scenario,
)
from llm_backoff_shim.lab.workload import WORDS, LengthDist, Workload, prompt_text
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

# -- length distributions -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64", LengthDist.fixed(64)),
        ("16-256", LengthDist.uniform(16, 256)),
        ("lognormal:64:0.8", LengthDist.lognormal(64, 0.8, 1, 512)),
        ("lognormal:64:0.8:1-512", LengthDist.lognormal(64, 0.8, 1, 512)),
        (" lognormal:10:0:5-20 ", LengthDist.lognormal(10, 0.0, 5, 20)),
    ],
)
def test_length_specs_parse(text: str, expected: LengthDist) -> None:
    assert LengthDist.parse(text) == expected
    assert LengthDist.parse(str(expected)) == expected


@pytest.mark.parametrize(
    "text", ["", "0", "-3", "5-2", "a-b", "lognormal:64", "lognormal:0:1", "lognormal:5:-1"]
)
def test_bad_length_specs_are_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="expected N, LOW-HIGH or lognormal"):
        LengthDist.parse(text)


def test_lognormal_draws_are_seeded_clamped_and_centred_on_the_median() -> None:
    dist = LengthDist.lognormal(64, 0.8, 1, 512)
    a = [dist.draw(random.Random(3)) for _ in range(3)]
    assert a == [dist.draw(random.Random(3)) for _ in range(3)]
    rng = random.Random(11)
    draws = [dist.draw(rng) for _ in range(5000)]
    assert min(draws) >= 1
    assert max(draws) <= 512
    assert 55 <= statistics.median(draws) <= 73
    assert len(set(draws)) > 100  # varied, not a constant
    assert max(draws) == 512  # the tail reaches the cap at sigma 0.8
    assert 70 < dist.mean() < 100  # a lognormal's mean is above its median


def test_fixed_and_uniform_draws() -> None:
    rng = random.Random(0)
    assert {LengthDist.fixed(7).draw(rng) for _ in range(20)} == {7}
    draws = {LengthDist.uniform(3, 5).draw(rng) for _ in range(200)}
    assert draws == {3, 4, 5}
    assert LengthDist.uniform(3, 5).mean() == 4


def test_prompt_text_is_the_asked_number_of_common_words() -> None:
    text = prompt_text(37, random.Random(1))
    words = text.split()
    assert len(words) == 37
    assert set(words) <= set(WORDS)
    assert text == prompt_text(37, random.Random(1))
    assert text != prompt_text(37, random.Random(2))


# -- arrivals and per-class budgets ------------------------------------------------------


def _scenario(**kw: Any) -> Scenario:
    base: dict[str, Any] = {
        "name": "t",
        "burst": 10,
        "rate_factor": 2.0,
        "duration": 10.0,
        "deadline": 8.0,
        "ttft_budget": 2.0,
    }
    base.update(kw)
    return Scenario(**base)


def test_a_workload_adds_lengths_without_moving_instants_or_classes() -> None:
    plain = arrivals(_scenario(), 3.0, random.Random(5))
    varied = arrivals(_scenario(workload=Workload()), 3.0, random.Random(5))
    assert [(a.at, a.cls) for a in plain] == [(a.at, a.cls) for a in varied]
    assert all(a.prompt is None and a.max_tokens is None and not a.ignore_eos for a in plain)
    assert all(a.prompt and a.max_tokens and a.ignore_eos for a in varied)
    assert len({a.max_tokens for a in varied}) > 10
    words = [len(a.prompt.split()) for a in varied if a.prompt]
    assert min(words) >= 5
    assert max(words) <= 200
    assert len(set(words)) > 10
    assert varied == arrivals(_scenario(workload=Workload()), 3.0, random.Random(5))


def test_each_class_has_its_own_deadline_and_ttft_budget() -> None:
    same = _scenario()
    assert (same.deadline_of("interactive"), same.deadline_of("batch")) == (8.0, 8.0)
    split = _scenario(batch_deadline=20.0)
    assert (split.deadline_of("interactive"), split.deadline_of("batch")) == (8.0, 20.0)
    assert (split.ttft_budget_of("interactive"), split.ttft_budget_of("batch")) == (2.0, 20.0)
    assert split.longest_deadline == 20.0
    assert "20 s (batch)" in split.describe(1.0)
    with pytest.raises(ValueError, match="batch_deadline"):
        _scenario(batch_deadline=0.0)


def test_capacity_follows_the_workloads_mean_answer() -> None:
    shape = EngineShape(slots=8, ttft=0.2, itl=0.01, output_tokens=20, prefill_time_per_token=0.0)
    fixed = Workload(prompt_words=LengthDist.fixed(10), output_tokens=LengthDist.fixed(101))
    assert shape.service_time_for(fixed) == pytest.approx(0.2 + 100 * 0.01)
    prefilling = EngineShape(slots=8, ttft=0.2, itl=0.01, output_tokens=20, prefill_time_per_token=0.001)
    # 10 words: 13 tokens + the chat template's 4, as the simulator counts.
    assert prefilling.service_time_for(fixed) == pytest.approx(0.2 + 0.017 + 100 * 0.01)
    assert shape.capacity_for(fixed) == pytest.approx(8 / 1.2)
    assert shape.token_capacity_for(fixed) == pytest.approx(8 / 1.2 * 101)
    assert shape.capacity_for(None) == shape.capacity


def test_a_gpu_profile_shape_is_timed_with_every_slot_busy() -> None:
    shape = EngineShape.from_profile("gpu-small")
    assert shape.slots == 128
    assert shape.full_itl == pytest.approx(0.015 * (1 + 0.019 * 127))
    fixed = Workload(prompt_words=LengthDist.fixed(10), output_tokens=LengthDist.fixed(101))
    assert shape.service_time_for(fixed) == pytest.approx(0.03 + 17 * 0.0001 + 100 * shape.full_itl)
    flags = shape.sim_flags()
    assert flags[:2] == ["--profile", "gpu-small"]
    assert flags[flags.index("--itl-batch-factor") + 1] == "0.019"
    # The default shape's batch does not slow tokens: its timing holds at any load.
    assert EngineShape().full_itl == EngineShape().itl


def test_the_profile_demo_load_is_sized_to_the_engine() -> None:
    shape = EngineShape.from_profile("gpu-large")
    scenario = profile_demo_scenario(shape, quick=True)
    assert scenario.burst == 3 * 256 + 16
    assert scenario.deadline >= 3 * shape.service_time_for(scenario.workload)
    assert scenario.deadline_of("batch") == pytest.approx(1.5 * scenario.deadline)
    assert scenario.ttft_budget == 2.0


# -- useful tokens and failures ------------------------------------------------------------


def _record(i: int, cls: str, outcome: str, *, ttft: float | None, end: float, tokens: int) -> CallRecord:
    scenario = _scenario(batch_deadline=20.0)
    record = CallRecord(
        i,
        cls,  # type: ignore[arg-type]
        0.0,
        scenario.deadline_of(cls),  # type: ignore[arg-type]
        ttft_budget=scenario.ttft_budget_of(cls),  # type: ignore[arg-type]
    )
    record.start = 0.0
    record.first_token = ttft
    record.end = end
    record.outcome = outcome  # type: ignore[assignment]
    record.tokens = tokens
    return record


def test_useful_tokens_count_only_answers_served_within_their_class_budget() -> None:
    calls = [
        _record(0, "interactive", "ok", ttft=0.5, end=1.0, tokens=100),  # in budget
        _record(1, "interactive", "ok", ttft=3.0, end=4.0, tokens=50),  # began too late
        _record(2, "batch", "ok", ttft=12.0, end=15.0, tokens=30),  # batch: its deadline only
        _record(3, "batch", "deadline", ttft=5.0, end=20.0, tokens=0),
        _record(4, "interactive", "error", ttft=None, end=0.2, tokens=0),  # fast typed error
        _record(5, "interactive", "error", ttft=None, end=1.5, tokens=0),
    ]
    result = RunResult(
        SHIM_PLAIN,
        _scenario(batch_deadline=20.0),
        capacity=2.0,
        calls=calls,
        samples=[],
        engine_stats={"tokens_generated": 400, "aborted_tokens": 20},
        elapsed=20.0,
        token_capacity=10.0,
    )
    f = figures(result)
    assert [c.within_budget for c in calls] == [True, False, True, False, False, False]
    assert f.useful_tokens == 130
    assert f.interactive_within_budget == 1
    assert f.interactive_calls == 4
    assert (f.batch_ok, f.batch_calls, f.batch_served) == (1, 2, 0.5)
    assert f.useful_ceiling == pytest.approx(10.0 * (10.0 + 20.0))
    assert f.useful_fraction == pytest.approx(130 / 300)
    assert f.failed_under_1s == 1
    assert f.failed_fast_share == pytest.approx(1 / 3)
    assert f.failure_p90 == 20.0
    assert f.wasted_fraction == pytest.approx(0.05)
    text = table(f) + comparison([f])
    assert "useful tokens" in text
    assert "130 = 43% of the ceiling 300" in text
    assert "1/4" in text


# -- engines: the simulator and a Prometheus-only engine ---------------------------------------


def test_metric_sum_adds_label_sets_and_skips_longer_names() -> None:
    text = (
        "# HELP vllm:generation_tokens_total x\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 120.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 30\n'
        "vllm:generation_tokens_total_other 9\n"
        "vllm:num_requests_running 3\n"
    )
    assert metric_sum(text, "vllm:generation_tokens_total") == 150.0
    assert metric_sum(text, "vllm:num_requests_running") == 3.0
    assert metric_sum(text, "vllm:num_requests_waiting") is None


def _prometheus_engine(counter: list[float]) -> Starlette:
    """An engine exposing only vLLM's metric names (what a real vLLM offers the probe)."""

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(
            f'vllm:num_requests_running{{engine="0"}} 0\nvllm:num_requests_waiting{{engine="0"}} 0\n'
            f'vllm:generation_tokens_total{{engine="0"}} {counter[0]}\n'
        )

    return Starlette(routes=[Route("/metrics", metrics)])


def test_a_prometheus_engine_is_read_from_its_counters_and_waste_is_what_was_not_delivered() -> None:
    counter = [1000.0]

    async def scenario(url: str) -> dict[str, Any]:
        import httpx2

        async with httpx2.AsyncClient(timeout=5.0) as client:
            probe = EngineProbe(client, url)
            await probe.reset()
            assert probe.is_sim is False
            assert await probe.occupancy() == (0, 0)
            counter[0] += 250  # the engine generated 250 tokens during the run
            return await probe.settled_stats(delivered=200)

    with ServerThread(_prometheus_engine(counter)) as engine:
        stats = asyncio.run(scenario(engine.url))
    assert stats["tokens_generated"] == 250
    assert stats["aborted_tokens"] == 50


def test_a_varied_run_sends_each_calls_lengths_and_records_usage() -> None:
    workload = Workload(
        prompt_words=LengthDist.uniform(5, 60), output_tokens=LengthDist.lognormal(6, 0.8, 1, 20)
    )
    scenario = Scenario(
        "t", burst=6, rate_factor=0, duration=0, deadline=10.0, ttft_budget=10.0, workload=workload
    )
    calls = arrivals(scenario, 1.0, random.Random(4))
    config = SimConfig(max_num_seqs=4, ttft=0.01, itl=0.002, output_tokens=1000, itl_batch_factor=0)
    with ServerThread(create_sim_app(config)) as sim:
        run = LoadRun(
            DIRECT_PLAIN,
            scenario,
            calls,
            target_url=sim.url,
            engine_url=sim.url,
            capacity=1.0,
            token_capacity=100.0,
        )
        result = asyncio.run(run.run())
    assert [c.outcome for c in result.calls] == ["ok"] * 6
    assert [c.tokens for c in result.calls] == [a.max_tokens for a in calls]
    by_words = sorted(
        (len(a.prompt.split()), c.prompt_tokens) for a, c in zip(calls, result.calls, strict=True) if a.prompt
    )
    assert by_words[0][1] < by_words[-1][1]  # a longer prompt counts more prompt tokens
    assert result.engine_stats["tokens_generated"] == sum(a.max_tokens or 0 for a in calls)
    f = figures(result)
    assert f.useful_tokens == sum(a.max_tokens or 0 for a in calls)


def test_llm_backoff_callers_through_a_real_shim_send_their_lengths_and_per_class_deadlines() -> None:
    from llm_backoff_shim.lab.scenario import SHIM_BACKOFF
    from llm_backoff_shim.serve.app import create_app
    from llm_backoff_shim.serve.config.settings import ShimSettings

    workload = Workload(prompt_words=LengthDist.uniform(5, 30), output_tokens=LengthDist.uniform(3, 12))
    scenario = Scenario(
        "t",
        burst=6,
        rate_factor=0,
        duration=0,
        deadline=8.0,
        ttft_budget=4.0,
        batch_deadline=12.0,
        workload=workload,
    )
    calls = arrivals(scenario, 1.0, random.Random(2))
    config = SimConfig(max_num_seqs=2, ttft=0.01, itl=0.002, output_tokens=1000, itl_batch_factor=0)
    with ServerThread(create_sim_app(config)) as sim:
        settings = ShimSettings(upstream=sim.url, max_concurrency=2, max_queue=8, initial_service_time=0.05)
        with ServerThread(create_app(settings)) as shim:
            run = LoadRun(
                SHIM_BACKOFF,
                scenario,
                calls,
                target_url=shim.url,
                engine_url=sim.url,
                shim_url=shim.url,
                capacity=1.0,
            )
            result = asyncio.run(run.run())
    assert [c.outcome for c in result.calls] == ["ok"] * 6
    # ignore_eos and max_tokens went through llm_backoff and the shim to the engine.
    assert [c.tokens for c in result.calls] == [a.max_tokens for a in calls]
    assert {c.deadline for c in result.calls if c.cls == "batch"} <= {12.0}
    assert {c.deadline for c in result.calls if c.cls == "interactive"} <= {8.0}
    assert all(c.within_budget for c in result.calls)


def test_presets_callers_get_each_classes_sdk_preset() -> None:
    """``llm_backoff_presets`` wraps with no policy: each class runs the SDK's own preset."""
    import httpx2

    from llm_backoff import RetryPolicy
    from llm_backoff.wrap import _engine_of
    from llm_backoff_shim.lab.callers import build_clients
    from llm_backoff_shim.lab.scenario import SHIM_BACKOFF, SHIM_PRESETS

    scenario = Scenario("t", burst=2, rate_factor=0, duration=0, deadline=8.0, ttft_budget=4.0)
    http_client = httpx2.AsyncClient()
    presets = build_clients(SHIM_PRESETS, scenario, "http://127.0.0.1:9", http_client)
    assert _engine_of(presets["interactive"]).policy == RetryPolicy.interactive()
    assert _engine_of(presets["batch"]).policy == RetryPolicy.batch()
    stated = build_clients(SHIM_BACKOFF, scenario, "http://127.0.0.1:9", http_client)
    assert _engine_of(stated["interactive"]).policy.deadline == 8.0
    shorter = dataclasses.replace(SHIM_PRESETS, interactive_fields=(("max_retry_after", 1.0),))
    fast = build_clients(shorter, scenario, "http://127.0.0.1:9", http_client)
    assert _engine_of(fast["interactive"]).policy == RetryPolicy.interactive(max_retry_after=1.0)
    assert _engine_of(fast["batch"]).policy == RetryPolicy.batch()


def test_a_caller_with_an_answer_length_stops_reading_there_whatever_max_tokens_says() -> None:
    """Clients that send ``max_tokens: 4096`` or none are played with answers of a drawn length:
    the caller closes its stream at that length and the engine drops the rest."""
    scenario = Scenario("t", burst=2, rate_factor=0, duration=0, deadline=10.0, ttft_budget=10.0)
    calls = [
        Arrival(0, 0.0, "interactive", "a short question", 4096, True, 7),
        Arrival(1, 0.0, "batch", "another question", None, True, 5),
    ]
    config = SimConfig(max_num_seqs=4, ttft=0.01, itl=0.002, output_tokens=400, itl_batch_factor=0)
    with ServerThread(create_sim_app(config)) as sim:
        run = LoadRun(DIRECT_PLAIN, scenario, calls, target_url=sim.url, engine_url=sim.url, capacity=1.0)
        result = asyncio.run(run.run())
    assert [c.outcome for c in result.calls] == ["ok", "ok"]
    assert [c.tokens for c in result.calls] == [7, 5]
    assert [c.max_tokens for c in result.calls] == [4096, None]
    # The engine stopped each answer when its caller left, long before 400 (or 4096) tokens.
    assert result.engine_stats["tokens_generated"] < 2 * 400
