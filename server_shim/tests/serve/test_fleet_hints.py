"""The fleet's Retry-After shared through a real redis-server (LLM_BACKOFF_TEST_REDIS_URL):
the script's answer for replicas refusing one call, Redis failing on the refusal path, and two
shims on loopback answering one call's refusals as a load balancer would ask them."""

from __future__ import annotations

import concurrent.futures as cf
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from llm_backoff_shim.decide.fleet_size import FleetSize
from llm_backoff_shim.serve.policy.fleet_hints import RECORD_TTL_MS, FleetHints
from llm_backoff_shim.serve.serving import ServerThread, free_socket
from llm_backoff_shim.sim.server import SimConfig, create_sim_app
from llm_backoff_shim.testing import ManualClock

redis = pytest.importorskip("redis")
REDIS_URL = os.environ.get("LLM_BACKOFF_TEST_REDIS_URL")
pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(
        not REDIS_URL, reason="LLM_BACKOFF_TEST_REDIS_URL not set (scripts/test.sh starts redis)"
    ),
]
PREFIX = "llm-backoff:hint:"


def redis_now() -> float:
    """Redis' own clock (``TIME``), the one the hints' script measures places by: the test's
    bounds are exact in it, whatever the test process's pace."""
    client = redis.Redis.from_url(REDIS_URL)
    seconds, micros = client.time()
    client.close()
    return float(seconds) + micros / 1e6


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[list[FleetHints], FleetSize]]:
    """Three replicas' hints, each with its own client (as three processes would have)."""
    assert REDIS_URL is not None
    fleet = FleetSize(ManualClock(0.0))
    made = [
        FleetHints.from_url(REDIS_URL, fleet=fleet, clock=ManualClock(0.0), minimum=0.05) for _ in range(3)
    ]
    yield made, fleet
    for hints in made:
        await hints.close()


async def test_the_replica_asked_last_answers_the_soonest_wait(
    replicas: tuple[list[FleetHints], FleetSize],
) -> None:
    (a, b, c), fleet = replicas
    rid = secrets.token_hex(8)
    t0 = redis_now()
    assert await a.soonest(rid, 5.0) == 5.0  # alone so far: its own
    assert fleet.replicas == 1
    left = await b.soonest(rid, 9.0)
    # a's place is sooner: what is left of a's 5 s by the Redis clock the script reads (to the
    # millisecond the record keeps), so at least 5 s less what that clock counted meanwhile.
    assert 5.0 - (redis_now() - t0) - 0.002 <= left <= 5.0
    assert await c.soonest(rid, 2.0) == 2.0  # its own is the soonest
    assert fleet.replicas == 3
    # The record: one return time per replica, in Redis milliseconds, expiring on its own.
    client = redis.Redis.from_url(REDIS_URL)
    record = client.hgetall(PREFIX + rid)
    assert {k.decode() for k in record} == {a.replica_id, b.replica_id, c.replica_id}
    assert 0 < client.pttl(PREFIX + rid) <= RECORD_TTL_MS
    client.close()


async def test_a_replica_asked_twice_keeps_its_sooner_place(
    replicas: tuple[list[FleetHints], FleetSize],
) -> None:
    (a, b, _), fleet = replicas
    rid = secrets.token_hex(8)
    t0 = redis_now()
    await a.soonest(rid, 3.0)
    await b.soonest(rid, 8.0)
    left = await a.soonest(rid, 7.0)
    assert 3.0 - (redis_now() - t0) - 0.002 <= left <= 3.0
    assert fleet.replicas == 2  # two replicas, though asked three times


async def test_a_call_without_an_id_and_a_hint_below_the_floor(
    replicas: tuple[list[FleetHints], FleetSize],
) -> None:
    (a, b, _), _ = replicas
    assert await a.soonest(None, 4.0) == 4.0
    rid = secrets.token_hex(8)
    await a.soonest(rid, 0.01)  # a place due at once (below the floor of 0.05 s)
    assert await b.soonest(rid, 1.0) == 0.05


async def test_a_redis_that_does_not_answer_costs_one_refusal_a_pause() -> None:
    with free_socket() as sock:  # a port nobody listens on
        url = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    clock = ManualClock(0.0)
    hints = FleetHints.from_url(url, fleet=FleetSize(clock), clock=clock, minimum=0.05, pause=1.0)
    calls = 0
    script = hints._script

    async def counted(**kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await script(**kwargs)

    hints._script = counted
    assert await hints.soonest("r1", 3.0) == 3.0  # its own hint: the documented answer alone
    assert await hints.soonest("r2", 2.0) == 2.0
    assert calls == 1  # within the pause Redis is not asked
    clock.advance(1.0)
    assert await hints.soonest("r3", 2.5) == 2.5
    assert calls == 2
    await hints.close()


def test_two_shims_answer_one_calls_refusals_with_the_soonest_wait(
    make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    """As a load balancer asks them: each shim full (one slot, no queue), one call id asked of
    the slow replica, then the fast one, then the slow one again."""
    config = SimConfig(
        max_num_seqs=4, ttft=0.0, itl=0.005, output_tokens=1000, output_tokens_sigma=0.0, seed=3
    )
    common: dict[str, Any] = {
        "max_concurrency": 1,
        "max_queue": 0,
        "retry_after_min": 0.05,
        "fleet_retry_after": True,
        # A loaded test machine must not fall back to each replica's own hint (tested above).
        "redis_url": f"{REDIS_URL}?socket_timeout=5",
    }
    with ServerThread(create_sim_app(config)) as sim:
        fast = make_shim(sim.url, initial_service_time=2.0, **common)
        slow = make_shim(sim.url, initial_service_time=12.0, **common)
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1000,
        }  # 5 s
        with cf.ThreadPoolExecutor(2) as pool:
            held = [
                pool.submit(httpx.post, f"{s.url}/v1/chat/completions", json=body, timeout=60)
                for s in (fast, slow)
            ]
            for shim in (fast, slow):
                waiter(lambda s=shim: s.runtime.controller.in_flight() == 1, what="a slot held")
            rid = secrets.token_hex(8)

            answered: list[float] = []

            def ask(shim: Any) -> float:
                r = httpx.post(
                    f"{shim.url}/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=10
                )
                answered.append(time.monotonic())
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "queue_full"
                return int(r.headers["retry-after-ms"]) / 1000

            first_slow, then_fast, again_slow = ask(slow), ask(fast), ask(slow)
            other = httpx.post(f"{slow.url}/v1/chat/completions", json=body, timeout=10)  # another call
            assert first_slow > 8.0  # the slow replica's own: about its 12 s prior
            assert then_fast < 3.0  # the fast replica's own is the sooner
            # Asked last, it answers what is left of the fast one's place: the fast replica gave
            # it after ``answered[0]``, the slow one answers before ``answered[2]`` (whole ms).
            assert then_fast - (answered[2] - answered[0]) - 0.002 <= again_slow <= then_fast + 0.002
            assert int(other.headers["retry-after-ms"]) / 1000 > 8.0  # another call: the slow replica's own
            for shim in (fast, slow):
                # Both learnt the fleet from the call (each was asked after the other once).
                assert httpx.get(f"{shim.url}/shim/state").json()["fleet_replicas"] == 2
                assert "llm_backoff_shim_fleet_replicas 2.0" in httpx.get(f"{shim.url}/metrics").text
            assert [f.result().status_code for f in held] == [200, 200]
        for shim in (fast, slow):  # every slot came back
            waiter(lambda s=shim: s.runtime.controller.in_flight() == 0, what="slots back")
