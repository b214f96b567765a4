"""Callers' attempts counted once across the fleet, through a real redis-server
(LLM_BACKOFF_TEST_REDIS_URL): what the shared record says of each try, Redis failing, and two
shims on loopback asked for one call as a load balancer asks them, their ``/metrics`` counting
one attempt per call (and a lone shim counting every request as one)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_backoff_shim.serve.policy.fleet_attempts import Admission, FleetAttempts, attempt_key
from llm_backoff_shim.serve.policy.fleet_hints import connect
from llm_backoff_shim.serve.serving import ServerThread, free_socket
from llm_backoff_shim.sim.server import SimConfig, create_sim_app
from llm_backoff_shim.testing import ManualClock

redis = pytest.importorskip("redis")
REDIS_URL = os.environ.get("LLM_BACKOFF_TEST_REDIS_URL")
needs_redis = pytest.mark.skipif(
    not REDIS_URL, reason="LLM_BACKOFF_TEST_REDIS_URL not set (scripts/test.sh starts redis)"
)


@pytest.fixture
async def replicas() -> AsyncIterator[list[FleetAttempts]]:
    """Three replicas' records, each with its own client (as three processes would have)."""
    assert REDIS_URL is not None
    clients = [connect(REDIS_URL) for _ in range(3)]
    yield [FleetAttempts(c, clock=ManualClock(0.0)) for c in clients]
    for client in clients:
        await client.aclose()


def test_the_attempt_key_is_the_id_and_the_load_balancers_stamp() -> None:
    assert attempt_key(None, 1733352000.123) is None
    assert attempt_key("abc", None) == "abc"
    # nginx's "t=1733352000.123" and HAProxy's "t=1733352000123" name the same attempt.
    assert (
        attempt_key("abc", 1733352000.123) == attempt_key("abc", 1733352000123 / 1000) == "abc@1733352000123"
    )


@pytest.mark.redis
@needs_redis
async def test_one_attempt_refused_twice_then_admitted_is_one_refusal_and_one_rescue(
    replicas: list[FleetAttempts],
) -> None:
    a, b, c = replicas
    key = attempt_key(secrets.token_hex(8), 1733352000.5)
    assert await a.refused(key, "queue_full") is True  # the attempt's first try
    assert await b.refused(key, "queue_timeout") is False  # a later try
    assert await a.refused(key, "queue_full") is False  # HAProxy asking a replica again
    # The first refusal's code is the one rescued, whoever refused later.
    assert await c.admitted(key) == Admission(first=False, rescued_from="queue_full")
    # Sent on again after an admission (the engine refused it): neither first nor a rescue.
    assert await b.admitted(key) == Admission(first=False)
    assert await a.refused(key, "queue_full") is False


@pytest.mark.redis
@needs_redis
async def test_an_attempt_admitted_at_once_and_a_retry_reusing_the_id(replicas: list[FleetAttempts]) -> None:
    a, b, _ = replicas
    rid = secrets.token_hex(8)
    first, retry = attempt_key(rid, 1733352000.5), attempt_key(rid, 1733352001.7)
    assert await a.admitted(first) == Admission(first=True)
    assert await b.refused(first, "queue_full") is False  # after the admission: not the first try
    # The caller's own retry, same id, stamped anew by the load balancer: a new attempt.
    assert await b.refused(retry, "queue_full") is True
    assert await a.admitted(retry) == Admission(first=False, rescued_from="queue_full")
    # Without an id every try is its own attempt.
    assert await a.refused(None, "queue_full") is True
    assert await a.admitted(None) == Admission(first=True)


async def test_a_redis_that_does_not_answer_counts_each_try_as_an_attempt() -> None:
    with free_socket() as sock:  # a port nobody listens on
        url = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    clock = ManualClock(0.0)
    client = connect(url)
    attempts = FleetAttempts(client, clock=clock, pause=1.0)
    calls = 0
    script = attempts._refused

    async def counted(**kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await script(**kwargs)

    attempts._refused = counted
    assert await attempts.refused("r1", "queue_full") is True
    assert await attempts.refused("r1", "queue_full") is True  # within the pause: alone
    assert await attempts.admitted("r1") == Admission(first=True)
    assert calls == 1
    clock.advance(1.0)
    assert await attempts.refused("r2", "queue_full") is True
    assert calls == 2
    await client.aclose()


def counts(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The shim's counters of tries and attempts, by name and labels, non-zero only."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if (
                s.name.endswith("_total")
                and s.value
                and family.name.split("shim_")[-1]
                in (
                    "requests",
                    "attempts",
                    "rescues",
                )
            ):
                out[(s.name.removeprefix("llm_backoff_shim_"), tuple(sorted(s.labels.items())))] = s.value
    return out


def series(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted({"class": "interactive", **labels}.items()))


BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}  # 5 s
SHORT = {**BODY, "max_tokens": 1}


def two_shims(make_shim: Callable[..., Any], **settings: Any) -> Any:
    """A simulator and two shims in front of it, one slot and no queue each."""
    config = SimConfig(
        max_num_seqs=4, ttft=0.0, itl=0.005, output_tokens=1000, output_tokens_sigma=0.0, seed=3
    )
    sim = ServerThread(create_sim_app(config)).start()
    common: dict[str, Any] = {"max_concurrency": 1, "max_queue": 0, **settings}
    return sim, make_shim(sim.url, **common), make_shim(sim.url, **common)


@pytest.mark.redis
@needs_redis
def test_two_shims_count_a_call_refused_by_one_and_served_by_the_other_once(
    make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    """As a load balancer asks them: ``full`` holds a call, ``free`` has its slot. Call 1 is
    refused by ``full`` and served by ``free``; call 2 (``free`` now held too) is refused by
    both, then the caller retries it with the same id (stamped anew) and ``full`` refuses it."""
    sim, full, free = two_shims(make_shim, fleet_retry_after=True, redis_url=f"{REDIS_URL}?socket_timeout=5")
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(httpx.post, f"{full.url}/v1/chat/completions", json=BODY, timeout=60)]
            waiter(lambda: full.runtime.controller.in_flight() == 1, what="full's slot held")

            def ask(shim: Any, rid: str, start: str, body: dict[str, Any] = SHORT) -> int:
                headers = {"x-request-id": rid, "x-request-start": start}
                return httpx.post(f"{shim.url}/v1/chat/completions", json=body, headers=headers).status_code

            one, two = secrets.token_hex(8), secrets.token_hex(8)
            assert [ask(full, one, "t=1733352000.100"), ask(free, one, "t=1733352000.100")] == [429, 200]
            held.append(pool.submit(httpx.post, f"{free.url}/v1/chat/completions", json=BODY, timeout=60))
            waiter(lambda: free.runtime.controller.in_flight() == 1, what="free's slot held")
            assert [ask(free, two, "t=1733352001.200"), ask(full, two, "t=1733352001.200")] == [429, 429]
            assert ask(full, two, "t=1733352002.300") == 429  # the caller's retry: a new attempt

            # Besides the held calls (an attempt each, admitted), three attempts: call 1's
            # (refused first, rescued by ``free``) and call 2's two (refused).
            want_full = {
                series("requests_total", outcome="admitted", code=""): 1,
                series("requests_total", outcome="rejected", code="queue_full"): 3,
                series("attempts_total", outcome="admitted", code=""): 1,
                series("attempts_total", outcome="rejected", code="queue_full"): 2,  # call 1, the retry
            }
            want_free = {
                series("requests_total", outcome="admitted", code=""): 2,
                series("requests_total", outcome="completed", code=""): 1,
                series("requests_total", outcome="rejected", code="queue_full"): 1,
                series("attempts_total", outcome="admitted", code=""): 1,
                series("attempts_total", outcome="rejected", code="queue_full"): 1,  # call 2
                series("rescues_total", code="queue_full"): 1,  # call 1
            }
            # Admissions are looked up off the request's path: wait for their counts.
            for shim, want in ((full, want_full), (free, want_free)):
                waiter(lambda s=shim, w=want: counts(s.url) == w, what=f"counts {want}")
            assert [f.result().status_code for f in held] == [200, 200]
    finally:
        sim.stop()


def test_a_lone_shim_counts_every_request_as_an_attempt(
    make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    """Without the fleet's record (no --fleet-retry-after) tries are attempts, ids or not."""
    sim, shim, _ = two_shims(make_shim)
    try:
        rid = {"x-request-id": "same", "x-request-start": "t=1733352000.100"}
        assert httpx.post(f"{shim.url}/v1/chat/completions", json=SHORT, headers=rid).status_code == 200
        with cf.ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, f"{shim.url}/v1/chat/completions", json=BODY, timeout=60)
            waiter(lambda: shim.runtime.controller.in_flight() == 1, what="the slot held")
            for _ in range(2):
                r = httpx.post(f"{shim.url}/v1/chat/completions", json=SHORT, headers=rid)
                assert r.status_code == 429
            assert held.result().status_code == 200
        waiter(
            lambda: counts(shim.url).get(series("requests_total", outcome="completed", code="")) == 2,
            what="both completions counted",
        )
        assert counts(shim.url) == {
            series("requests_total", outcome="admitted", code=""): 2,
            series("requests_total", outcome="completed", code=""): 2,
            series("requests_total", outcome="rejected", code="queue_full"): 2,
            series("attempts_total", outcome="admitted", code=""): 2,
            series("attempts_total", outcome="rejected", code="queue_full"): 2,
        }
    finally:
        sim.stop()
