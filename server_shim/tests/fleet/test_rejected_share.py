"""The fleet's rejected share counts callers' attempts: shims behind a real nginx and a real
HAProxy on loopback (the shipped configurations), sharing the fleet's record in Redis
(``--fleet-retry-after``), and the shipped recording rule evaluated by Prometheus' own
``promtool`` on the counters the shims exported.

Three simulated engines, a shim each with one slot and no queue. With two replicas' slots held,
calls through the load balancer are refused by the held replicas it asks first and served by
the third (or, behind HAProxy, which may ask the held two by turns, refused); with all three
held, every call is refused by every replica asked, and some callers retry with the same
``X-Request-Id`` (a new attempt: the load balancer stamps it anew). Every step waits for the
shims' own gauges or counters: no step depends on how fast the machine is.

The rule's share is then exactly what the callers saw: their refused attempts over their
attempts. (Counting tries, as the rule did, says far more: each refused call is refused by
every replica asked.)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llm_backoff_shim.lab.fleet import Fleet
from llm_backoff_shim.lab.prometheus import SHIPPED_RULES

ITL = 0.02  # seconds per token: a call's length is max_tokens * ITL
TIMEOUT = 120  # the test's own limit (pytest-timeout)
HELD = TIMEOUT + 10  # a held call outlasts the test
SIM_FLAGS = (
    "--ttft", "0", "--itl", str(ITL), "--itl-batch-factor", "0", "--prefill-time-per-token", "0",
    "--output-tokens", str(round(HELD / ITL)), "--output-tokens-sigma", "0",
)  # fmt: skip
REDIS_URL = os.environ.get("LLM_BACKOFF_TEST_REDIS_URL")
SHORT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
RULE = "job:llm_backoff_shim_capacity_rejections:ratio_rate5m"

pytestmark = pytest.mark.timeout(TIMEOUT)


@pytest.fixture(params=["nginx", "haproxy"])
def fleet(request: pytest.FixtureRequest, need: Callable[[str], None]) -> Iterator[Fleet]:
    need(request.param)
    if not REDIS_URL:
        if os.environ.get("CI"):
            pytest.fail("LLM_BACKOFF_TEST_REDIS_URL is not set, and CI must run this test (scripts/test.sh)")
        pytest.skip("LLM_BACKOFF_TEST_REDIS_URL not set")
    # socket_timeout: a loaded test machine must not fall back to counting tries alone.
    flags = (
        "--max-concurrency", "1", "--max-queue", "0",
        "--fleet-retry-after", "--redis-url", f"{REDIS_URL}?socket_timeout=5",
    )  # fmt: skip
    promtool()
    with Fleet(3, request.param, sim_flags=SIM_FLAGS, shim_flags=flags) as started:
        yield started


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed, and CI must run this test (scripts/test.sh installs it)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def held_call(url: str) -> socket.socket:
    """A call to the shim at ``url`` on a connection that reads nothing: it holds the slot
    until the socket is closed."""
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    payload = json.dumps({**SHORT, "max_tokens": round(HELD / ITL)}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


Counters = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def counters(url: str) -> Counters:
    """A shim's counters of tries (``requests_total``), attempts and rescues, by labels."""
    out: Counters = {}
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        if family.name in (
            "llm_backoff_shim_requests",
            "llm_backoff_shim_attempts",
            "llm_backoff_shim_rescues",
        ):
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(counts: list[Counters], name: str, **labels: str) -> float:
    return sum(
        v
        for c in counts
        for (n, have), v in c.items()
        if n == f"llm_backoff_shim_{name}_total" and labels.items() <= dict(have).items()
    )


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll ``predicate``; the timeout only bounds a broken test, it asserts no latency."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "llm_backoff_shim_in_flight"
        for s in f.samples
    )


def rule_on(counts: list[Counters], rules: Path, tmp_path: Path, expected: float, seen: str) -> None:
    """``promtool test rules``: the counters each shim exported, as series that rose from 0 to
    them within a minute and held, scraped all at the same instants (so no replica's rate is
    extrapolated differently); the rule over the 5 minutes that hold them is ``expected`` (to
    1e-9: promtool compares floats exactly, and the rule divides sums of rates)."""
    series = [
        {
            "series": f"{name}{{"
            + ",".join(f'{k}="{v}"' for k, v in (("job", "shims"), ("instance", str(i)), *labels))
            + "}",
            "values": f"0 {value:g}x10",
        }
        for i, c in enumerate(counts)
        for (name, labels), value in c.items()
    ]
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": f"abs({RULE} - {expected!r}) < bool 1e-9",
                        "eval_time": "5m",
                        "exp_samples": [{"labels": '{job="shims"}', "value": 1}],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "share-test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"{seen}\n{result.stdout}{result.stderr}"


def test_the_rules_rejected_share_is_the_callers(fleet: Fleet, tmp_path: Path) -> None:
    statuses: list[int] = []  # every caller's attempt through the load balancer: its answer
    held = [held_call(fleet.shim_urls[i]) for i in (0, 1)]
    try:
        wait_for("two slots held", lambda: [in_flight(u) for u in fleet.shim_urls] == [1, 1, 0])
        with httpx.Client(base_url=fleet.url, timeout=30) as client:
            for _ in range(9):
                statuses.append(client.post("/v1/chat/completions", json=SHORT).status_code)
            held.append(held_call(fleet.shim_urls[2]))
            wait_for("three slots held", lambda: [in_flight(u) for u in fleet.shim_urls] == [1, 1, 1])
            for k in range(6):
                # Callers 0-2 send without an id (the load balancer gives one); 3-5 each retry
                # once with the id of their first attempt, as an SDK configured with one does.
                headers = {"x-request-id": f"caller{k}-{os.getpid()}"} if k >= 3 else {}
                for _ in range(2 if k >= 3 else 1):
                    statuses.append(
                        client.post("/v1/chat/completions", json=SHORT, headers=headers).status_code
                    )
    finally:
        for sock in held:
            sock.close()

    served = statuses.count(200)
    refused = len(statuses) - served
    assert set(statuses) <= {200, 429, 503}, statuses
    assert served >= 1, statuses
    assert statuses[9] != 200, statuses
    assert statuses[9:] == [statuses[9]] * 9, statuses  # with the fleet full, every one refused
    callers = len(statuses) + 3  # and the three held calls, each an attempt admitted
    # Every attempt counted once, by the shims' own counters (admissions are looked up off the
    # request's path: wait for them), and exactly the refused ones less the rescued.
    wait_for(
        f"{callers} attempts counted",
        lambda: total([counters(u) for u in fleet.shim_urls], "attempts") == callers,
    )
    counts = [counters(u) for u in fleet.shim_urls]
    assert total(counts, "attempts", outcome="rejected") - total(counts, "rescues") == refused
    # The load balancer asked several replicas for each refused call: tries are not attempts.
    assert total(counts, "requests", outcome="rejected") > refused
    assert total(counts, "rescues") >= 1

    tries = total(counts, "requests", outcome="rejected"), total(counts, "requests", outcome="admitted")
    seen = f"callers: {refused} of {callers} refused; tries: {tries[0]:g} refused, {tries[1]:g} admitted"
    rule_on(counts, SHIPPED_RULES, tmp_path, refused / callers, seen)
