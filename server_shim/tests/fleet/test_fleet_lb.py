"""Shims behind a real nginx and a real HAProxy on loopback, running the shipped configurations.

Three simulated engines, a shim each with one slot and no queue (``--max-concurrency 1
--max-queue 0``), the load balancer in front (:class:`~llm_backoff_shim.lab.fleet.Fleet`):

- three slow calls at once are all admitted (one per replica) and a fourth is refused at
  once, with the shim's well-formed refusal, after the load balancer tried every replica;
- under a short overload (twice as many closed-loop callers as slots), a caller is refused
  only when the fleet is full. Measured from the shims' own access logs (times to the
  millisecond, one clock): a refusal counts as "given while another replica had a free slot"
  when, at the moment it was decided (the last replica's refusal of that request id), some
  replica had no call in flight (an admitted call occupies its slot from its arrival,
  ``time - total_ms``, to its end, ``time``), with 2 ms of slack for the logs' resolution;
- when every replica refuses, the Retry-After that reaches the caller is the soonest of the
  places the replicas gave that call (``--fleet-retry-after``: they share them in Redis);
- a 503 refusal with Retry-After (HAProxy's recipe) is waited out by the SDK and by plain
  openai as a 429 is;
- calls for whole answers in flight on an engine that crashes are sent by the load balancer
  to another replica (the dead engine's shim answers 503 before anything was relayed).

Bounded: a few seconds per test; nothing leaves loopback.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
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


def stamp(record: dict[str, Any]) -> float:
    """The end of a shim's access-log record, in seconds since the epoch."""
    return datetime.fromisoformat(record["time"]).timestamp()


def asked_by(fleet: Fleet, request_id: str) -> list[dict[str, Any]]:
    """Every replica's record of ``request_id`` (one per replica asked)."""
    return [
        {**rec, "replica": i}
        for i in range(len(fleet.replicas))
        for rec in fleet.access_records(i)
        if rec.get("request_id") == request_id
    ]


def test_n_calls_are_admitted_and_the_next_is_refused_at_once(fleet: Fleet, lb: str) -> None:
    with httpx.Client(base_url=fleet.url, timeout=30) as client, cf.ThreadPoolExecutor(3) as pool:

        def call(rid: str, seconds: float) -> tuple[httpx.Response, float]:
            response = client.post("/v1/chat/completions", json=body(seconds), headers={"x-request-id": rid})
            return response, time.time()

        # Calls long enough that all three still run when the fourth is sent, even on a loaded
        # machine where the three start seconds apart.
        slow = [pool.submit(call, f"slow{i}", 5.0) for i in range(3)]
        deadline = time.monotonic() + 10
        all_busy = False
        while not all_busy and not any(completed(fleet, i) for i in range(3)):
            # Admitted calls log at their end; wait instead until each shim holds its slot. A
            # refusal logs at once: a slow call that met a replica already holding another
            # (two picks before either was counted) is refused there and tried on the next,
            # so only a completed call ends the wait.
            busy = [httpx.get(f"{u}/metrics", timeout=2).text for u in fleet.shim_urls]
            all_busy = all(_in_flight(text) == 1 for text in busy)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        records = [
            (i, r.get("request_id"), r.get("outcome"), r.get("code"))
            for i in range(3)
            for r in fleet.access_records(i)
        ]
        assert all_busy, f"the three calls never held the three slots at once; shims' records: {records}"
        sent = time.time()
        refused, refused_at = call("extra", 2.0)
        answers = [f.result() for f in slow]

    assert [r.status_code for r, _ in answers] == [200, 200, 200]
    assert refused.status_code == REFUSAL_STATUS[lb], refused.text
    # Refused while all three calls were still running: the load balancer did not wait for a slot.
    assert refused_at < min(end for _, end in answers)
    assert int(refused.headers["retry-after"]) >= 1
    assert int(refused.headers["retry-after-ms"]) > 0
    error = refused.json()["error"]
    assert error["code"] == "queue_full"
    assert error["retry_after_seconds"] > 0
    # Every replica was asked (HAProxy may ask one twice: it avoids only the one it just asked),
    # and refused; each admitted exactly one of the three.
    logged(fleet)
    asked = asked_by(fleet, "extra")
    assert {r["replica"] for r in asked} == {0, 1, 2}
    assert {r["outcome"] for r in asked} == {"rejected"}
    admitted = [completed(fleet, i) for i in range(3)]
    assert [len(a) for a in admitted] == [1, 1, 1]
    print(f"\n{lb}: 4th call refused after {1000 * (refused_at - sent):.1f} ms, {len(asked)} asks")


def completed(fleet: Fleet, replica: int) -> list[dict[str, Any]]:
    """The replica's access records of calls it served to their end."""
    return [r for r in fleet.access_records(replica) if r.get("outcome") == "completed"]


def _in_flight(metrics_text: str) -> float:
    """Calls holding a slot, all classes together, from a shim's /metrics."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == "llm_backoff_shim_in_flight"
        for sample in family.samples
    )


def held_call(url: str, seconds: float) -> socket.socket:
    """A call of ``seconds`` to the shim at ``url``, on a connection of its own that reads
    nothing: it holds its slot until the socket is closed (the shim then cancels it)."""
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    payload = json.dumps(body(seconds)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def wait_holding(urls: list[str], timeout: float = 10.0) -> None:
    """Until every shim at ``urls`` shows a call holding its slot (its own in-flight gauge)."""
    deadline = time.monotonic() + timeout
    while True:
        held = [_in_flight(httpx.get(f"{u}/metrics", timeout=2).text) for u in urls]
        if all(n >= 1 for n in held):
            return
        assert time.monotonic() < deadline, f"calls in flight at the shims: {held}"
        time.sleep(0.02)


#: Slack around a refusal's moment: the shims log times to the millisecond, and a slot freed
#: and taken again within a millisecond or two is the race every balancer has.
SLACK = 0.002


def free_at(busy: list[tuple[float, float]], moment: float) -> bool:
    """True when the slot whose busy intervals are ``busy`` was free around ``moment``."""
    return not any(start - SLACK <= moment <= end + SLACK for start, end in busy)


def test_callers_are_refused_only_when_the_fleet_is_full(fleet: Fleet, lb: str) -> None:
    """Twice as many closed-loop callers as slots for 3 s; a refused caller tries again 50 ms later."""
    callers, run_for, call_s, pause = 6, 3.0, 0.2, 0.05
    refusals: list[tuple[str, float, float]] = []  # request id, sent, answered
    hints: dict[str, float] = {}  # request id -> the Retry-After that reached the caller
    served = 0
    lock = threading.Lock()
    stop_at = time.monotonic() + run_for

    def caller(n: int) -> None:
        nonlocal served
        k = 0
        with httpx.Client(base_url=fleet.url, timeout=30) as client:
            while time.monotonic() < stop_at:
                rid = f"c{n}-{k}"
                k += 1
                sent = time.time()
                response = client.post(
                    "/v1/chat/completions", json=body(call_s), headers={"x-request-id": rid}
                )
                answered = time.time()
                assert response.status_code in (200, REFUSAL_STATUS[lb]), response.text
                with lock:
                    if response.status_code == 200:
                        served += 1
                    else:
                        refusals.append((rid, sent, answered))
                        hints[rid] = int(response.headers["retry-after-ms"]) / 1000
                if response.status_code != 200:
                    time.sleep(pause)

    with cf.ThreadPoolExecutor(callers) as pool:
        for f in [pool.submit(caller, n) for n in range(callers)]:
            f.result()
    records = logged(fleet)
    busy = [
        [(stamp(r) - r["total_ms"] / 1000, stamp(r)) for r in recs if r["outcome"] == "completed"]
        for recs in records
    ]
    asked: dict[str, set[int]] = {}
    for i, recs in enumerate(records):
        for r in recs:
            asked.setdefault(r["request_id"], set()).add(i)

    # The moment a caller's refusal was decided: the last replica's refusal of it.
    decided: dict[str, float] = {}
    for recs in records:
        for r in recs:
            if r["outcome"] == "rejected":
                decided[r["request_id"]] = max(stamp(r), decided.get(r["request_id"], 0.0))
    not_all_asked = [rid for rid, _, _ in refusals if asked.get(rid, set()) != {0, 1, 2}]
    with_free_slot = [
        rid for rid, _, answered in refusals if any(free_at(b, decided.get(rid, answered)) for b in busy)
    ]
    share = len(with_free_slot) / max(1, len(refusals))
    own: dict[str, list[float]] = {}
    for recs in records:
        for r in recs:
            if r["outcome"] == "rejected":
                own.setdefault(r["request_id"], []).append(r["retry_after_s"])
    ratios = sorted(hints[rid] / min(own[rid]) for rid, _, _ in refusals if rid in own)
    if ratios:
        print(
            f"\n{lb}: Retry-After delivered / soonest replica's: median {ratios[len(ratios) // 2]:.2f},"
            f" p90 {ratios[int(0.9 * (len(ratios) - 1))]:.2f}, max {ratios[-1]:.2f}"
        )
    print(
        f"\n{lb}: {served} served, {len(refusals)} refused; not every replica asked: {len(not_all_asked)}"
        f" ({100 * len(not_all_asked) / max(1, len(refusals)):.1f} %); refused while another replica had"
        f" a free slot: {len(with_free_slot)} ({100 * share:.1f} %)"
    )
    assert served > 0
    assert refusals, "the overload did not happen"
    assert share <= 0.02, with_free_slot


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
        # Every replica asked recorded its place: all three behind nginx; HAProxy's redispatch
        # may ask one twice and another not at all (6-12 % of refusals, docs/deploy.md).
        assert len(places) == 3 or (lb == "haproxy" and len(places) == 2), places
        # The soonest place, told at most ``since`` before the record was read (whole ms).
        assert places[0] - 0.002 <= delivered <= places[0] + since + 0.002, (delivered, places, since)
    assert any(len(places) == 3 for _, places, _ in rows), rows
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
