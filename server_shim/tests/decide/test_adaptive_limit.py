"""The gradient concurrency limit: pure state updates with a fake clock, a closed-loop engine
model with a knee, and the limit plugged into a real shim in front of the simulator."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from llm_backoff_shim.decide.adaptive_limit import GradientConfig, GradientLimit
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app
from llm_backoff_shim.testing import ManualClock


def probing(limit: GradientLimit) -> bool:
    # A call, not the property: mypy would narrow the property across on_sample() calls.
    return limit.probing


def probed(config: GradientConfig, baseline: float = 0.1) -> tuple[GradientLimit, ManualClock]:
    clock = ManualClock(0.0)
    limit = GradientLimit(config, clock)
    assert not probing(limit)
    assert limit.baseline is None
    limit.on_sample(baseline, config.min_limit)
    assert limit.baseline == pytest.approx(baseline)
    return limit, clock


def test_the_baseline_is_the_lowest_sample_then_the_median_of_each_probe() -> None:
    clock = ManualClock(0.0)
    limit = GradientLimit(GradientConfig(min_limit=2, probe_samples=3, probe_interval=10), clock)
    assert limit.limit == 2
    limit.on_sample(0.3, 2)
    limit.on_sample(0.2, 2)
    limit.on_sample(0.4, 2)
    assert limit.baseline == pytest.approx(0.2)
    clock.now += 10
    limit.on_sample(0.4, 2)  # starts a probe (this sample is its first)
    assert probing(limit)
    assert limit.limit == 2
    limit.on_sample(5.0, 9)  # a leftover from higher concurrency: ignored
    limit.on_sample(0.5, 2)
    limit.on_sample(0.6, 2)
    assert not probing(limit)
    assert limit.baseline == pytest.approx(0.5)  # the engine got slower: the probe says so


def test_flat_latency_at_full_use_grows_the_limit_up_to_the_max() -> None:
    limit, _ = probed(GradientConfig(min_limit=1, max_limit=20))
    seen = [limit.limit]
    for _ in range(200):
        limit.on_sample(0.1, limit.limit)
        seen.append(limit.limit)
    assert seen == sorted(seen)
    assert seen[-1] == 20


def test_an_unused_limit_does_not_grow() -> None:
    limit, _ = probed(GradientConfig(min_limit=4, max_limit=64))
    for _ in range(100):
        limit.on_sample(0.1, 1)
    assert limit.limit == 4


def test_rising_latency_pulls_the_limit_down_to_the_headroom_floor() -> None:
    limit, _ = probed(GradientConfig(min_limit=1, max_limit=40))
    for _ in range(100):
        limit.on_sample(0.1, limit.limit)
    high = limit.limit
    for _ in range(100):
        limit.on_sample(1.0, limit.limit)  # 10x the baseline: gradient 0.5
    # The fixed point of L = 0.5 L + sqrt(L) is 4: the headroom keeps probing upward.
    assert high > limit.limit == 4


def test_overload_backs_off_at_once_and_probes_recur() -> None:
    limit, clock = probed(GradientConfig(min_limit=1, max_limit=40, probe_interval=30))
    for _ in range(100):
        limit.on_sample(0.1, limit.limit)
    before = limit.estimate
    limit.on_complete(service_time=1.0, in_flight=5, overloaded=True)
    assert limit.estimate == pytest.approx(before * 0.9)
    limit.on_complete(service_time=1.0, in_flight=5, overloaded=False)
    assert limit.estimate == pytest.approx(before * 0.9)
    clock.now += 31
    limit.on_sample(0.1, 5)
    assert probing(limit)
    assert limit.limit == 1
    for _ in range(5):
        limit.on_sample(0.3, 1)
    assert not probing(limit)
    assert limit.limit == int(limit.estimate)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="min_limit"):
        GradientConfig(min_limit=5, max_limit=4)
    with pytest.raises(ValueError, match="smoothing"):
        GradientConfig(smoothing=0)


@pytest.mark.parametrize("knee", [4, 8, 16])
def test_closed_loop_settles_near_the_knee_of_an_engine_model(knee: int) -> None:
    """An engine that runs ``knee`` sequences at once: TTFB is flat up to the knee, then requests
    wait for a running one to finish (about a whole generation, 10x TTFT)."""
    clock = ManualClock(0.0)
    limit = GradientLimit(GradientConfig(min_limit=1, max_limit=64, probe_interval=30), clock)
    ttft, generation = 0.05, 0.5
    history = []
    for _ in range(3000):
        c = limit.limit  # saturated demand: every slot is used
        waiting = max(0, c - knee)
        ttfb = ttft + generation * waiting / knee
        clock.now += generation / max(c, 1)
        limit.on_sample(ttfb, c)
        history.append(limit.limit)
    settled = history[1000:]
    mean = sum(settled) / len(settled)
    assert 0.6 * knee <= mean <= 1.6 * knee, (knee, mean)
    assert max(settled) < 3 * knee


@pytest.fixture
def sim() -> Iterator[ServerThread]:
    config = SimConfig(max_num_seqs=2, ttft=0.02, itl=0.004, output_tokens=10, seed=11)
    with ServerThread(create_sim_app(config)) as server:
        yield server


def test_the_shim_runs_with_an_adaptive_limit_and_exports_it(
    sim: ServerThread, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(sim.url, adaptive_concurrency=True, max_concurrency=16, max_queue=100)
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    def call(_: int) -> int:
        return httpx.post(shim.url + "/v1/chat/completions", json=body, timeout=30).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(call, range(24)))
    assert statuses == [200] * 24
    policy = shim.runtime.policy
    assert policy is not None
    limit = policy.limit
    assert isinstance(limit, GradientLimit)
    assert limit.baseline is not None  # the start-up probe measured the engine
    assert 1 <= limit.limit <= 16
    samples = shim.metrics()
    assert samples[("llm_backoff_shim_concurrency_limit", ())] == limit.limit
    assert samples[("llm_backoff_shim_adaptive_ttfb_baseline_seconds", ())] == pytest.approx(limit.baseline)
    waiter(lambda: shim.state()["interactive"] == (0, 0), what="slots back")
