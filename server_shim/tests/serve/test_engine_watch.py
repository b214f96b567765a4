"""Engine-aware admission: metric parsing, the saturation detector, and a saturated simulator end to end."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.classes import ClassShares, SharedSlots
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.saturation import EngineSample, SaturationConfig, SaturationDetector
from llm_backoff_shim.decide.tickets import Outcome, Ticket, TicketState
from llm_backoff_shim.serve.config.tuning import Tuning
from llm_backoff_shim.serve.policy.engine_watch import parse_engine_metrics
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app
from llm_backoff_shim.testing import ManualClock

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_running{engine="1",model_name="m"} 8.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.97
"""

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller


def test_parse_sums_engines_and_takes_the_fullest_kv_cache() -> None:
    sample = parse_engine_metrics(VLLM_TEXT)
    assert sample == EngineSample(waiting=3.0, running=15.0, kv_cache=0.97)


def test_parse_reads_the_older_gpu_cache_name_and_refuses_non_vllm_text() -> None:
    old = "vllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n"
    assert parse_engine_metrics(old) == EngineSample(0.0, 0.0, 0.5)
    with pytest.raises(ValueError, match="num_requests_waiting"):
        parse_engine_metrics("http_requests_total 5\n")


def test_detector_saturates_on_waiting_or_kv_cache_and_forgets_stale_metrics() -> None:
    clock = ManualClock(10.0)
    detector = SaturationDetector(SaturationConfig(max_waiting=2, max_kv_cache=0.9, stale_after=1.0), clock)
    assert detector.stale()
    assert not detector.saturated()  # nothing known: the concurrency cap rules
    detector.observe(EngineSample(waiting=2, running=8, kv_cache=0.5))
    assert not detector.saturated()
    detector.observe(EngineSample(waiting=3, running=8, kv_cache=0.5))
    assert detector.saturated()
    assert detector.hold(None)
    assert not detector.hold("batch")  # a class-level hold is not what saturation means
    detector.observe(EngineSample(waiting=0, running=8, kv_cache=0.9))
    assert detector.saturated()
    clock.now += 1.5
    assert detector.stale()
    assert not detector.saturated()
    detector.observe(EngineSample(waiting=0, running=1, kv_cache=None))
    assert not detector.saturated()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_kv_cache"):
        SaturationConfig(max_kv_cache=1.5)
    with pytest.raises(ValueError, match="stale_after"):
        SaturationConfig(stale_after=0)


@pytest.fixture
def sim() -> Iterator[ServerThread]:
    # One sequence at a time; a full answer takes about 1 s, a 3-token one a few ms.
    config = SimConfig(max_num_seqs=1, ttft=0.01, itl=0.005, output_tokens=200, seed=9)
    with ServerThread(create_sim_app(config)) as server:
        yield server


def post(url: str, max_tokens: int | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def test_a_saturated_engine_stops_admission_until_it_recovers(
    sim: ServerThread, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(
        sim.url,
        max_concurrency=4,
        engine_metrics=True,
        tuning=Tuning(engine_poll_interval=0.02, engine_stale_polls=250),  # stale after 5 s
    )
    policy = shim.runtime.policy
    assert policy is not None
    detector = policy.detector
    assert detector is not None
    waiter(lambda: detector.last is not None, what="first scrape")
    assert not detector.saturated()
    with ThreadPoolExecutor(6) as pool:
        # Someone else (not through the shim) fills the engine: one running, one waiting.
        direct = [pool.submit(post, sim.url) for _ in range(2)]
        waiter(detector.saturated, what="the shim to see the engine's waiting request")
        through = [pool.submit(post, shim.url, 3) for _ in range(3)]
        waiter(lambda: shim.state()["interactive"] == (0, 3), what="3 queued in the shim")
        # The shim has free slots (4) yet sends nothing while the engine says it is saturated.
        assert detector.saturated()
        assert shim.state()["interactive"] == (0, 3)
        answers = [f.result() for f in through]
        assert all(f.result().status_code == 200 for f in direct)
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert all(int(a.headers["x-queue-time-ms"]) > 0 for a in answers)
    samples = shim.metrics()
    assert samples[("llm_backoff_shim_engine_metrics_stale", ())] == 0
    assert ("llm_backoff_shim_engine_waiting", ()) in samples
    waiter(lambda: shim.state()["interactive"] == (0, 0), what="slots back")


def test_an_upstream_without_metrics_falls_back_to_the_concurrency_cap(
    upstream: Any, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(
        upstream.url, max_concurrency=2, engine_metrics=True, tuning=Tuning(engine_poll_interval=0.02)
    )
    policy = shim.runtime.policy
    assert policy is not None
    assert policy.watch is not None
    waiter(lambda: policy.watch is not None and policy.watch.failures >= 2, what="failed scrapes")
    assert policy.detector is not None
    assert policy.detector.stale()
    headers = {"x-fake-hold": "1"}
    with ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(
                httpx.post,
                shim.url + "/v1/chat/completions",
                json={"model": "m"},
                headers=headers,
                timeout=30,
            )
            for _ in range(3)
        ]
        # Not unlimited: the cap of 2 still holds. Not stuck: 2 go upstream.
        waiter(lambda: shim.state()["interactive"] == (2, 1), what="2 in flight, 1 queued")
        upstream.release()
        assert [f.result().status_code for f in futures] == [200, 200, 200]
    assert shim.metrics()[("llm_backoff_shim_engine_metrics_stale", ())] == 1


# -- the shim's own admissions between scrapes ----------------------------------------------


def test_admissions_since_the_scrape_count_once_the_engines_slots_are_known() -> None:
    clock = ManualClock(10.0)
    sent = [0]
    detector = SaturationDetector(SaturationConfig(max_waiting=1), clock, in_flight=lambda: sent[0])
    detector.observe(EngineSample(waiting=0, running=3, kv_cache=None))
    sent[0] = 10
    # Slots unknown (the engine never showed a queue): only the scrape counts, as without counting.
    assert detector.engine_slots is None
    assert not detector.hold(None)
    detector.observe(EngineSample(waiting=2, running=8, kv_cache=None))  # a full engine: 8 slots
    assert detector.engine_slots == 8
    assert detector.expected_waiting() == 2
    assert detector.saturated()
    sent[0] = 9  # one left the engine: one waiting moved up
    assert detector.expected_waiting() == 1
    assert detector.hold(None)
    sent[0] = 8
    assert detector.expected_waiting() == 0
    assert not detector.hold(None)
    sent[0] = 9  # admitted since the scrape: counted before the next one shows it
    assert detector.expected_waiting() == 1
    assert not detector.saturated()
    assert detector.hold(None)
    assert not detector.hold("batch")
    clock.now += 5.0  # stale: the concurrency cap rules again
    assert detector.expected_waiting() is None
    assert not detector.hold(None)


def test_a_scrape_counts_from_when_it_was_sent() -> None:
    clock = ManualClock(0.0)
    sent = [8]
    detector = SaturationDetector(SaturationConfig(max_waiting=0), clock, in_flight=lambda: sent[0])
    detector.observe(EngineSample(waiting=1, running=7, kv_cache=None))  # 7 slots
    then = detector.in_flight_now()
    sent[0] = 9  # admitted while the scrape was on its way, not yet seen by the engine
    detector.observe(EngineSample(waiting=1, running=7, kv_cache=None), then)
    assert detector.expected_waiting() == 2


@pytest.mark.parametrize("seed", range(5))
def test_the_engines_queue_stays_within_max_waiting_between_scrapes(
    make_controller: MakeController, seed: int
) -> None:
    """The shim is the engine's only client, its cap (16) above the engine's 8 slots. Arrivals,
    completions and scrapes in random order: once a scrape has shown the engine full, no
    admission makes the engine's own queue longer than Tuning.engine_max_waiting (none waiting)."""
    rng = random.Random(seed)
    slots, max_waiting = 8, 2
    scheduler = SharedSlots(ClassShares())
    controller, clock = make_controller(
        16, classes=("interactive",), max_queue=1000, max_wait=1e6, scheduler=scheduler
    )
    detector = SaturationDetector(
        SaturationConfig(max_waiting=max_waiting, stale_after=1e9), clock, in_flight=controller.in_flight
    )
    scheduler.add_hold(detector.hold)
    running: list[Ticket] = []
    admissions_after_learning = [0]

    def engine_sample() -> EngineSample:
        n = controller.in_flight()
        return EngineSample(waiting=max(0, n - slots), running=min(n, slots), kv_cache=None)

    def admitted(tickets: list[Ticket]) -> None:
        running.extend(tickets)
        if tickets and detector.engine_slots is not None:
            admissions_after_learning[0] += len(tickets)
            assert controller.in_flight() - slots <= max_waiting

    for _ in range(20):  # before any scrape the cap alone rules: the engine's queue overfills
        decision = controller.submit(AdmissionRequest("interactive"))
        assert isinstance(decision, Ticket)
        if decision.state is TicketState.ADMITTED:
            running.append(decision)
    assert controller.in_flight() == 16
    for _ in range(400):
        clock.now += 0.01
        roll = rng.random()
        if roll < 0.45:
            decision = controller.submit(AdmissionRequest("interactive"))
            assert isinstance(decision, Ticket)
            if decision.state is TicketState.ADMITTED:
                admitted([decision])
        elif roll < 0.85 and running:
            done = running.pop(rng.randrange(len(running)))
            admitted(controller.release(done, Outcome.COMPLETED).admitted)
        else:
            detector.observe(engine_sample())
            admitted(controller.reschedule().admitted)
    assert detector.engine_slots == slots
    assert admissions_after_learning[0] > 20  # the invariant was put to the test


@pytest.fixture
def slow_poll_sim() -> Iterator[ServerThread]:
    config = SimConfig(max_num_seqs=1, ttft=0.01, itl=0.005, output_tokens=200, seed=9)
    with ServerThread(create_sim_app(config)) as server:
        yield server


def test_through_the_shim_admissions_between_scrapes_do_not_queue_in_the_engine(
    slow_poll_sim: ServerThread, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    """The simulator has 1 slot, the shim a cap of 4. Once the shim has seen the engine full (its
    slots), 4 requests at once send 1 to the engine and queue 3 in the shim with no scrape
    between them; counted on the scrapes alone, all 4 went. The test scrapes when it means to
    (the shim's own poll is an hour away): a poll that lands while an admitted request is still
    on its way to the engine reads it as idle, a race of the poll's timing, not the count's."""
    sim = slow_poll_sim
    shim = make_shim(
        sim.url,
        max_concurrency=4,
        engine_metrics=True,
        tuning=Tuning(engine_poll_interval=3600.0, engine_stale_polls=100),
    )
    policy = shim.runtime.policy
    assert policy is not None
    assert policy.detector is not None
    assert policy.watch is not None
    detector, watch, loop = policy.detector, policy.watch, shim.server.loop
    assert loop is not None

    def scraped() -> bool:
        asyncio.run_coroutine_threadsafe(watch.scrape_once(), loop).result(5)
        return True

    with ThreadPoolExecutor(4) as pool:
        direct = [pool.submit(post, sim.url) for _ in range(2)]  # someone fills the engine once
        waiter(lambda: scraped() and detector.engine_slots == 1, what="the engine's slots learned")
        assert all(f.result().status_code == 200 for f in direct)

    def idle() -> bool:
        last = detector.last
        return scraped() and last is not None and (last.running, last.waiting) == (0, 0)

    waiter(idle, what="a scrape of the idle engine")
    with ThreadPoolExecutor(4) as pool:
        through = [pool.submit(post, shim.url) for _ in range(4)]
        waiter(lambda: sum(shim.state()["interactive"]) == 4, what="4 in the shim")
        waiter(lambda: shim.state()["interactive"][0] >= 1, what="one sent to the engine")
        assert shim.state()["interactive"] == (1, 3)
        assert [f.result().status_code for f in through] == [200] * 4
    waiter(lambda: shim.state()["interactive"] == (0, 0), what="slots back")


def test_the_engines_slots_follow_the_latest_full_scrape() -> None:
    detector = SaturationDetector(SaturationConfig(), ManualClock(0.0), in_flight=lambda: 0)
    detector.observe(EngineSample(waiting=3, running=8, kv_cache=None))
    assert detector.engine_slots == 8
    detector.observe(EngineSample(waiting=0, running=5, kv_cache=None))  # not full: says nothing
    assert detector.engine_slots == 8
    detector.observe(EngineSample(waiting=2, running=4, kv_cache=None))  # restarted smaller
    assert detector.engine_slots == 4
    detector.observe(EngineSample(waiting=0, running=6, kv_cache=None))  # runs more than that
    assert detector.engine_slots == 6
