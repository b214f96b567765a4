"""Shims behind a real nginx and a real HAProxy on loopback, running the shipped configurations.

Three simulated engines, a shim each with one slot and no queue (``--max-concurrency 1
--max-queue 0``), the load balancer in front (:class:`~llm_backoff_shim.lab.fleet.Fleet`):

- three calls at once are all admitted (one per replica) and a fourth is refused at once,
  with the shim's well-formed refusal, after the load balancer tried every replica;
- a caller is refused only when the fleet is full: with two replicas' slots held through the
  load balancer, every further call is served by the third;
- when every replica refuses, the Retry-After that reaches the caller is the soonest of the
  places the replicas gave that call (``--fleet-retry-after``: they share them in Redis);
- a 503 refusal with Retry-After (HAProxy's recipe) is waited out by the SDK and by plain
  openai as a 429 is;
- calls for whole answers in flight on an engine that crashes are sent by the load balancer
  to another replica (the dead engine's shim answers 503 before anything was relayed).

The calls that fill slots hold them until the test closes their connections, and each step
waits for the shims' own in-flight gauges to show the state it needs: no step depends on how
fast the machine is. (How often a fleet under a real overload refuses while a replica is free
is measured by the scoreboard's fleet scenario, docs/benchmarks.md.) Bounded: a few seconds per test;
nothing leaves loopback.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_backoff_shim.lab.fleet import Fleet

ITL = 0.02  # seconds per token, whatever the batch: a call's length is max_tokens * ITL
TIMEOUT = 120  # each test's own limit (pytest-timeout)
#: A call that holds its slot for longer than a test may run (the sim's answers are this long
#: unless max_tokens cuts them).
HELD = TIMEOUT + 10
SIM_FLAGS = (
    "--ttft", "0", "--itl", str(ITL), "--itl-batch-factor", "0", "--prefill-time-per-token", "0",
    "--output-tokens", str(round(HELD / ITL)), "--output-tokens-sigma", "0",
)  # fmt: skip
JSON_LOGS = ("--log-level", "info", "--log-format", "json")  # access logs the tests read
ONE_SLOT = ("--max-concurrency", "1", "--max-queue", "0", *JSON_LOGS)
REFUSAL_STATUS = {"nginx": 429, "haproxy": 503}

pytestmark = pytest.mark.timeout(TIMEOUT)


@pytest.fixture(params=["nginx", "haproxy"])
def lb(request: pytest.FixtureRequest, need: Callable[[str], None]) -> str:
    name: str = request.param
    need(name)
    return name


@pytest.fixture
def fleet(lb: str) -> Iterator[Fleet]:
    with Fleet(3, lb, sim_flags=SIM_FLAGS, shim_flags=ONE_SLOT) as started:
        yield started


def body(seconds: float) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max(1, round(seconds / ITL)),
    }


def asked_by(fleet: Fleet, request_id: str) -> list[dict[str, Any]]:
    """Every replica's record of ``request_id`` (one per replica asked)."""
    return [
        {**rec, "replica": i}
        for i in range(len(fleet.replicas))
        for rec in fleet.access_records(i)
        if rec.get("request_id") == request_id
    ]


def test_n_calls_are_admitted_and_the_next_is_refused_at_once(fleet: Fleet, lb: str) -> None:
    # Three calls that hold their slots until the test closes their connections: the fourth is
    # sent only once every shim's own gauge shows its slot held, and the three are still held
    # when its answer comes (a load balancer that waited for a slot would hang here).
    held = [held_call(fleet.url, HELD, request_id=f"slow{i}") for i in range(3)]
    try:
        wait_holding(fleet.shim_urls)
        with httpx.Client(base_url=fleet.url, timeout=30) as client:
            sent = time.monotonic()
            refused = client.post("/v1/chat/completions", json=body(2.0), headers={"x-request-id": "extra"})
            refused_after = time.monotonic() - sent
        holding = in_flight(fleet.shim_urls)
    finally:
        for sock in held:
            sock.close()

    # Each shim admitted exactly one of the three, and still held it when the fourth was refused.
    assert holding == [1, 1, 1]
    assert refused.status_code == REFUSAL_STATUS[lb], refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert int(refused.headers["retry-after-ms"]) > 0
    error = refused.json()["error"]
    assert error["code"] == "queue_full"
    assert error["retry_after_seconds"] > 0
    # Every replica was asked (HAProxy may ask one more than once: a retry avoids only the
    # replica just asked), and refused.
    logged(fleet)
    asked = asked_by(fleet, "extra")
    assert {r["replica"] for r in asked} == {0, 1, 2}
    assert {r["outcome"] for r in asked} == {"rejected"}
    print(f"\n{lb}: 4th call refused after {1000 * refused_after:.1f} ms, {len(asked)} asks")


def _in_flight(metrics_text: str) -> float:
    """Calls holding a slot, all classes together, from a shim's /metrics."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == "llm_backoff_shim_in_flight"
        for sample in family.samples
    )


def held_call(url: str, seconds: float, request_id: str | None = None) -> socket.socket:
    """A call of ``seconds`` to ``url`` (a shim or the load balancer), on a connection of its own
    that reads nothing: it holds its slot until the socket is closed (the shim then cancels it)."""
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    payload = json.dumps(body(seconds)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n"
        + (f"x-request-id: {request_id}\r\n" if request_id else "")
        + "\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def in_flight(urls: list[str]) -> list[float]:
    """Calls holding a slot at each shim at ``urls`` (its own in-flight gauge)."""
    return [_in_flight(httpx.get(f"{u}/metrics", timeout=5).text) for u in urls]


def wait_in_flight(
    urls: list[str], done: Callable[[list[float]], bool], timeout: float = 30.0
) -> list[float]:
    """Until the shims' in-flight gauges pass ``done``; ``timeout`` only bounds a broken run."""
    deadline = time.monotonic() + timeout
    while True:
        held = in_flight(urls)
        if done(held):
            return held
        assert time.monotonic() < deadline, f"calls in flight at the shims: {held}"
        time.sleep(0.02)


def wait_holding(urls: list[str]) -> None:
    """Until every shim at ``urls`` shows a call holding its slot (its own in-flight gauge)."""
    wait_in_flight(urls, lambda held: all(n >= 1 for n in held))


def test_a_call_is_served_while_any_replica_has_a_slot_free(fleet: Fleet, lb: str) -> None:
    """Two calls through the load balancer hold two replicas' slots: every further call is served
    by the third, none refused. With all three held, a call is refused only after every replica
    was asked (the test above): a caller is refused only when the fleet is full. Each step waits
    on the shims' own gauges, not on time."""
    held = [held_call(fleet.url, HELD, request_id=f"hold{i}") for i in range(2)]
    try:
        holding = wait_in_flight(fleet.shim_urls, lambda n: sum(n) == 2)
        assert sorted(holding) == [0, 1, 1], holding
        free = holding.index(0)
        with httpx.Client(base_url=fleet.url, timeout=30) as client:
            for k in range(4):
                r = client.post("/v1/chat/completions", json=body(0.05), headers={"x-request-id": f"free{k}"})
                assert r.status_code == 200, r.text
        records = logged(fleet)
    finally:
        # HAProxy keeps a call whose caller went away running to its end (no abortonclose):
        # the fleet is stopped with it.
        for sock in held:
            sock.close()
    for k in range(4):
        served = {
            i
            for i, recs in enumerate(records)
            for r in recs
            if r["request_id"] == f"free{k}" and r["outcome"] == "completed"
        }
        assert served == {free}, (k, served, free)
    print(f"\n{lb}: four calls served by replica {free} while the other two were full")


def metric_counts(url: str) -> dict[str, float]:
    """A shim's own ``requests_total`` by outcome (all classes and codes), from its /metrics."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        if family.name == "llm_backoff_shim_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    outcome = sample.labels["outcome"]
                    counts[outcome] = counts.get(outcome, 0) + sample.value
    return counts


def logged(fleet: Fleet, timeout: float = 10.0) -> list[list[dict[str, Any]]]:
    """Every replica's access records, once each log holds every answer its /metrics counted
    (the shims write their access logs in batches, a little after the answer)."""
    deadline = time.monotonic() + timeout
    while True:
        records = [fleet.access_records(i) for i in range(len(fleet.replicas))]
        counts = [metric_counts(u) for u in fleet.shim_urls]
        if all(
            sum(r["outcome"] == outcome for r in recs) == c.get(outcome, 0)
            for recs, c in zip(records, counts, strict=True)
            for outcome in ("completed", "rejected")
        ):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"access logs and /metrics disagree: {counts}")
        time.sleep(0.1)


REDIS_URL = os.environ.get("LLM_BACKOFF_TEST_REDIS_URL")
HINT_KEY = "llm-backoff:hint:"  # fleet_hints.py: each call's record


@pytest.fixture
def fleet_shared_hints(lb: str) -> Iterator[Fleet]:
    """Hints below the default floor of 1 s, so replicas' estimates can be told apart, shared
    through Redis (``--fleet-retry-after``)."""
    if not REDIS_URL:
        if os.environ.get("CI"):
            pytest.fail("LLM_BACKOFF_TEST_REDIS_URL is not set, and CI must run this test (scripts/test.sh)")
        pytest.skip("LLM_BACKOFF_TEST_REDIS_URL not set")
    # socket_timeout: a loaded test machine must not fall back to each replica's own hint.
    url = f"{REDIS_URL}?socket_timeout=5"
    flags = (*ONE_SLOT, "--retry-after-min", "0.05", "--fleet-retry-after", "--redis-url", url)
    with Fleet(3, lb, sim_flags=SIM_FLAGS, shim_flags=flags) as started:
        yield started


def test_the_fleet_answers_the_soonest_replicas_wait(fleet_shared_hints: Fleet, lb: str) -> None:
    """Replicas that learned different call lengths (1.5, 0.75 and 0.375 s) all full, each
    holding a call until the test is done: the hint that reaches the caller is the soonest of
    the places the three replicas gave that call (their record in Redis, read right after the
    answer, on the Redis clock), not the last replica's."""
    import redis

    fleet = fleet_shared_hints
    lengths = (1.5, 0.75, 0.375)
    store = redis.Redis.from_url(REDIS_URL, socket_timeout=2)

    def direct(i: int, seconds: float) -> int:
        return httpx.post(
            f"{fleet.shim_urls[i]}/v1/chat/completions", json=body(seconds), timeout=30
        ).status_code

    # delivered, each replica's place (s from the read), seconds from sending to the read
    rows: list[tuple[float, list[float], float]] = []
    with cf.ThreadPoolExecutor(3) as pool:
        # Each replica learns its own service time (two calls of that length), then is kept busy
        # by a call that outlasts the test: however slowly the refused calls below go, every
        # replica is full for all of them.
        warm = [pool.submit(lambda i=i: [direct(i, lengths[i]) for _ in range(2)]) for i in range(3)]
        assert [f.result() for f in warm] == [[200, 200]] * 3
    busy = [held_call(url, HELD) for url in fleet.shim_urls]
    try:
        wait_holding(fleet.shim_urls)
        with httpx.Client(base_url=fleet.url, timeout=30) as client:
            for k in range(4):
                rid = f"ra{k}-{os.getpid()}-{time.monotonic_ns()}"
                sent = time.monotonic()
                r = client.post("/v1/chat/completions", json=body(1.0), headers={"x-request-id": rid})
                assert r.status_code == REFUSAL_STATUS[lb], r.text
                seconds, micros = store.time()
                since = time.monotonic() - sent  # the last replica answered within this
                now_ms = seconds * 1000 + micros / 1000
                places = sorted((int(v) - now_ms) / 1000 for v in store.hgetall(HINT_KEY + rid).values())
                rows.append((int(r.headers["retry-after-ms"]) / 1000, places, since))
                time.sleep(0.1)
    finally:
        for sock in busy:
            sock.close()
    store.close()

    print(f"\n{lb}: hint delivered vs the places the replicas gave the same call (s)")
    for delivered, places, _ in rows:
        print(f"  delivered {delivered:.3f}   places {[round(p, 3) for p in places]}")
    for delivered, places, since in rows:
        # Every replica asked recorded its place: all three, behind either load balancer.
        assert len(places) == 3, places
        # The soonest place, told at most ``since`` before the record was read (whole ms).
        assert places[0] - 0.002 <= delivered <= places[0] + since + 0.002, (delivered, places, since)
    # The replicas' places differed: a last replica's answer would often have been later.
    assert any(places[-1] > 2 * places[0] for _, places, _ in rows), rows


def test_sdk_and_openai_wait_out_a_503_refusal_with_retry_after(need: Callable[[str], None]) -> None:
    """HAProxy's recipe refuses with 503: both clients retry it after the hint, as for a 429."""
    lb = "haproxy"
    need(lb)
    openai = pytest.importorskip("openai")
    from llm_backoff import RetryEvent, RetryPolicy, wrap

    def watched(seen: list[tuple[float, str, int, str | None]]) -> Any:
        """An http client noting (time, request|response, status, retry-after-ms) of each exchange."""

        def on_request(request: Any) -> None:
            seen.append((time.monotonic(), "request", 0, None))

        def on_response(response: Any) -> None:
            seen.append(
                (time.monotonic(), "response", response.status_code, response.headers.get("retry-after-ms"))
            )

        return httpx.Client(event_hooks={"request": [on_request], "response": [on_response]})

    def refused_then_served(seen: list[tuple[float, str, int, str | None]]) -> tuple[float, float]:
        """(the first refusal's hint, seconds from that refusal to the next request)."""
        (t_refused, _, status, hint_ms), (t_again, kind, _, _) = seen[1], seen[2]
        assert status == 503
        assert kind == "request"
        assert hint_ms is not None
        assert seen[-1][2] == 200
        return int(hint_ms) / 1000, t_again - t_refused

    with Fleet(1, lb, sim_flags=SIM_FLAGS, shim_flags=ONE_SLOT) as fleet, cf.ThreadPoolExecutor(1) as pool:
        plain_seen: list[tuple[float, str, int, str | None]] = []
        busy = pool.submit(httpx.post, f"{fleet.url}/v1/chat/completions", json=body(1.5), timeout=30)
        wait_holding(fleet.shim_urls)
        plain = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", http_client=watched(plain_seen))
        plain.chat.completions.create(**body(0.1))
        assert busy.result().status_code == 200

        sdk_seen: list[tuple[float, str, int, str | None]] = []
        busy = pool.submit(httpx.post, f"{fleet.url}/v1/chat/completions", json=body(1.5), timeout=30)
        wait_holding(fleet.shim_urls)
        events: list[RetryEvent] = []
        sdk = wrap(
            openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", http_client=watched(sdk_seen)),
            RetryPolicy(deadline=20),
            on_retry=events.append,
        )
        sdk.chat.completions.create(**body(0.1))
        assert busy.result().status_code == 200

    hint, waited = refused_then_served(plain_seen)
    print(f"\nopenai: 503 with Retry-After-Ms {hint:.3f} s, next attempt {waited:.3f} s later")
    assert waited >= hint * 0.9
    # The SDK retries inside its transport (the client's response hook never sees the 503):
    # its retry event says what it was told and how long it waited.
    assert [e.reason for e in events] == ["status 503"]
    requests = [t for t, kind, _, _ in sdk_seen if kind == "request"]
    assert events[0].hint is not None
    print(
        f"SDK: 503 with hint {events[0].hint:.3f} s, waited {events[0].wait:.3f} s,"
        f" next attempt {requests[1] - requests[0]:.3f} s after the first"
    )
    assert events[0].wait >= events[0].hint * 0.9
    assert requests[1] - requests[0] >= events[0].hint * 0.9


def test_whole_answer_calls_on_a_crashed_engine_are_served_by_another_replica(lb: str) -> None:
    """An engine dies under four 1-second calls: its shim answers 503 ``upstream_unavailable``
    before anything was relayed, and the load balancer sends each call to the other replica."""
    with Fleet(2, lb, sim_flags=SIM_FLAGS, shim_flags=JSON_LOGS) as fleet:
        with httpx.Client(base_url=fleet.url, timeout=30) as client, cf.ThreadPoolExecutor(4) as pool:
            calls = [
                pool.submit(
                    client.post, "/v1/chat/completions", json=body(1.0), headers={"x-request-id": f"k{i}"}
                )
                for i in range(4)
            ]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if _in_flight(httpx.get(f"{fleet.shim_urls[0]}/metrics", timeout=2).text) > 0:
                    break
                time.sleep(0.02)
            fleet.kill_engine(0)
            statuses = [f.result().status_code for f in calls]
        records = logged(fleet)
    assert statuses == [200, 200, 200, 200]
    cut = [r for r in records[0] if r["outcome"] == "rejected"]
    assert cut, "no call was on the killed engine"
    assert {(r["status"], r["code"]) for r in cut} == {(503, "upstream_unavailable")}
    served = {r["request_id"] for r in records[1] if r["outcome"] == "completed"}
    assert {r["request_id"] for r in cut} <= served
    print(f"\n{lb}: {len(cut)} calls on the killed engine, all served by the other replica")


def _queued(metrics_text: str) -> float:
    """Calls waiting for a slot, all classes together, from a shim's /metrics."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == "llm_backoff_shim_queue_depth"
        for sample in family.samples
    )


def queued(urls: list[str]) -> list[float]:
    """Calls waiting for a slot at each shim at ``urls`` (its own queue gauge)."""
    return [_queued(httpx.get(f"{u}/metrics", timeout=5).text) for u in urls]


def wait_queued(urls: list[str], done: Callable[[list[float]], bool], timeout: float = 30.0) -> list[float]:
    """Until the shims' queue gauges pass ``done``; ``timeout`` only bounds a broken run."""
    deadline = time.monotonic() + timeout
    while True:
        waiting = queued(urls)
        if done(waiting):
            return waiting
        assert time.monotonic() < deadline, f"calls queued at the shims: {waiting}"
        time.sleep(0.02)


#: One slot and one queue place per replica; a queued call waits as long as the test may run.
SLOT_AND_PLACE = ("--max-concurrency", "1", "--max-queue", "1", "--max-queue-wait", str(HELD), *JSON_LOGS)


def test_a_call_reaches_the_one_replica_with_a_queue_place(lb: str) -> None:
    """Two replicas full (slot and queue place held by calls sent to their shims directly), the
    third holding one call the load balancer sent it, its queue place free: the load balancer
    counts one connection there and none at the full two, yet a call through it must reach the
    third and wait there for its slot, not be refused after asking only the full two."""
    pool = cf.ThreadPoolExecutor(1)
    with Fleet(3, lb, sim_flags=SIM_FLAGS, shim_flags=SLOT_AND_PLACE) as fleet:
        urls = fleet.shim_urls
        held = [held_call(fleet.url, HELD, request_id="through-lb")]
        try:
            holding = wait_in_flight(urls, lambda n: sum(n) == 1)
            room = holding.index(1)
            full = [i for i in range(3) if i != room]
            for i in full:
                held.append(held_call(urls[i], HELD))
            wait_in_flight(urls, lambda n: all(n[i] == 1 for i in full))
            for i in full:
                held.append(held_call(urls[i], HELD))
            wait_queued(urls, lambda q: all(q[i] == 1 for i in full))
            call = pool.submit(
                httpx.post,
                f"{fleet.url}/v1/chat/completions",
                json=body(0.05),
                headers={"x-request-id": "room"},
                timeout=60,
            )
            # Queued at the replica with room, or answered at once (refused).
            deadline = time.monotonic() + 30
            while not call.done() and queued(urls)[room] < 1:
                assert time.monotonic() < deadline, "the call neither queued nor was answered"
                time.sleep(0.02)
            waiting = queued(urls)
            answered = call.result() if call.done() else None
        finally:
            for sock in held:
                sock.close()
    pool.shutdown(wait=True)  # the queued call ends with the fleet
    assert answered is None, (answered.status_code, answered.text)
    assert waiting == [1, 1, 1], waiting
    print(f"\n{lb}: the call waits at replica {room}, the one with a queue place")


def test_nginx_answers_a_refusal_when_some_replica_refused_and_the_last_was_unreachable(
    need: Callable[[str], None],
) -> None:
    """One replica's shim stopped (its port refuses connections), the other two full: every call
    through nginx is a refusal (429 queue_full, the shim's format), also when nginx tried the
    stopped replica last, never "no replica of the fleet is reachable"."""
    need("nginx")
    with Fleet(3, "nginx", sim_flags=SIM_FLAGS, shim_flags=ONE_SLOT) as fleet:
        fleet.stop_shim(2)
        held = [held_call(u, HELD) for u in fleet.shim_urls[:2]]
        try:
            wait_holding(fleet.shim_urls[:2])
            answers: list[tuple[str, httpx.Response, list[str]]] = []
            last_unreachable = 0
            with httpx.Client(base_url=fleet.url, timeout=30) as client:
                # nginx takes the replicas in turn (none holds a call through it): within a few
                # calls one ends at the stopped replica.
                for k in range(9):
                    rid = f"down{k}"
                    r = client.post("/v1/chat/completions", json=body(1.0), headers={"x-request-id": rid})
                    tries = _nginx_tries(fleet, rid)
                    answers.append((rid, r, tries))
                    last_unreachable += tries[-1] == "502"
                    if last_unreachable:
                        break
        finally:
            for sock in held:
                sock.close()
    assert last_unreachable, "no call ended at the stopped replica"
    for rid, r, tries in answers:
        assert r.status_code == 429, (rid, r.status_code, r.text, tries)
        assert r.json()["error"]["code"] == "queue_full"
        assert r.headers["x-llm-backoff-refusal"] == "retry-queue-full"
        assert float(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["retry_after_seconds"] > 0
    print(f"\nnginx: tries of each call {[tries for _, _, tries in answers]}, each answered a refusal")


def _nginx_tries(fleet: Fleet, request_id: str) -> list[str]:
    """Each try's status of ``request_id``, in order, from nginx's access log (``upstatus=``)."""
    deadline = time.monotonic() + 10
    while True:
        for line in fleet.lb_log().splitlines():
            if f"rid={request_id} " in line:
                statuses = line.split("upstatus=", 1)[1].split(" rt=", 1)[0]
                return [s.strip() for s in statuses.replace(":", ",").split(",")]
        assert time.monotonic() < deadline, f"nginx logged no line for {request_id}"
        time.sleep(0.05)
