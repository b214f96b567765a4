"""The scaling signals, evaluated by a real Prometheus scraping three shims on loopback.

Every query in the KEDA ScaledObject and the Grafana dashboard (read from the files, Grafana's
variables substituted explicitly), every recorded series and every alert expression of the shipped
rules is evaluated while the fleet is idle and while it is loaded, and checked against what
docs/deploy.md says it is. Expected values come from the load's design and from what the callers
and the shims' own ``/metrics`` saw, never from Prometheus itself.

Two loads, each for what it can show exactly:

- Flowing (rates, waits, hints, shares): closed-loop callers keep each replica's two slots busy
  and its queue at 4, 2 and 1 requests, and one more caller keeps knocking on the full replica
  (refused with ``queue_full``). A closed loop cannot hold a level at every instant (a queue is
  one short from a call's end to its caller's next call), so its levels are not checked.
- Held (levels: queue depth, in flight, time to drain): two requests per replica that run for
  longer than the test may take hold the slots, and 4, 2 and 1 more sit in the queues, which
  nothing moves until the test lets go. The queries are evaluated at a moment whose scrapes and
  rule evaluation all came after each shim's ``/metrics`` showed those levels, and each shim's
  ``/metrics`` shows, after the queries were answered, the same levels and no request having
  left its queue or slot in between: every sample the queries read was taken at those levels.

Bounded: three simulator+shim pairs, scrape and rule evaluation every second, about 20 s in all.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llm_backoff_shim.lab import procs
from llm_backoff_shim.lab.prometheus import (
    SHIPPED_RULES,
    PromClient,
    PrometheusServer,
    Sample,
    host_port,
    prometheus_binary,
)

REPO = Path(__file__).resolve().parents[3]
KEDA = REPO / "server_shim" / "deploy" / "kubernetes" / "keda-scaledobject.yaml"
DASHBOARD = REPO / "server_shim" / "deploy" / "grafana" / "llm-backoff-shim-dashboard.json"

SCRAPE = 1.0
#: Grafana's $__rate_interval is max($__interval + scrape interval, 4 x scrape interval), with the
#: data source's scrape interval; 4 x 1 s here (the $__interval of a short range is below 1 s).
RATE_INTERVAL = "4s"
RATE_WINDOW = 4.0
#: The namespace label the Prometheus Operator would attach: the KEDA queries select on it.
NAMESPACE = "llm-serving"

SLOTS = 2
MAX_QUEUE = 4
QUEUED = (4, 2, 1)  # waiting requests held at each replica; replica 0's queue is full
SERVICE_TOKENS = 20  # a flowing caller's answer: 0.02 + 20 x 0.02 s = 0.42 s
TIMEOUT = 90  # the test's own limit (pytest-timeout)
#: A held request's answer: 0.02 s a token for longer than the test may run, so no held request
#: ends (and none leaves its queue) before the test lets go of it.
HOLD_TOKENS = 2 * TIMEOUT * 50
SIM_FLAGS = (
    "--max-num-seqs", "4", "--ttft", "0.02", "--itl", "0.02", "--itl-batch-factor", "0",
    "--output-tokens", str(HOLD_TOKENS), "--output-tokens-sigma", "0", "--seed", "3",
)  # fmt: skip
#: A queued held request waits longer than the test may run (never refused with queue_timeout).
SHIM_FLAGS = (
    "--max-concurrency", str(SLOTS), "--max-queue", str(MAX_QUEUE), "--max-queue-wait", str(2 * TIMEOUT),
)  # fmt: skip
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": SERVICE_TOKENS}
HOLD_BODY = {**BODY, "max_tokens": HOLD_TOKENS}

pytestmark = pytest.mark.timeout(TIMEOUT)


def _need_prometheus() -> None:
    if prometheus_binary() is None:
        if os.environ.get("CI"):
            pytest.fail(
                "prometheus is not installed, and CI must run this test (scripts/test.sh installs it)"
            )
        pytest.skip("prometheus is not installed (apt-get install prometheus)")


# --------------------------------------------------------------------------- the fleet


@dataclass
class Pair:
    sim: procs.ChildServer
    shim: procs.ChildServer

    @property
    def target(self) -> str:
        return host_port(self.shim.url)


def start_pairs(count: int, sim_flags: Sequence[str], shim_flags: Sequence[str]) -> list[Pair]:
    """``count`` simulators, each with its own shim, started at once (stopped again on failure)."""
    pairs = [
        Pair(procs.sim_server(sim_flags), procs.ChildServer("shim", lambda _p: [])) for _ in range(count)
    ]
    for pair in pairs:
        pair.shim = procs.shim_server(pair.sim, shim_flags)
    try:
        for pair in pairs:
            pair.sim.launch()
        for pair in pairs:
            pair.sim.start()
            pair.shim.launch()
        for pair in pairs:
            pair.shim.start()
    except BaseException:
        for pair in pairs:
            pair.shim.close()
            pair.sim.close()
        raise
    return pairs


@pytest.fixture
def fleet() -> Iterator[tuple[list[Pair], PrometheusServer]]:
    _need_prometheus()
    pairs = start_pairs(3, SIM_FLAGS, SHIM_FLAGS)
    try:
        with PrometheusServer(
            [p.target for p in pairs], scrape_interval=SCRAPE, labels={"namespace": NAMESPACE}
        ) as prometheus:
            prometheus.client.wait_up([p.target for p in pairs])
            yield pairs, prometheus
    finally:
        for pair in pairs:
            pair.shim.close()
            pair.sim.close()


# --------------------------------------------------------------------------- the load


@dataclass(frozen=True)
class Answer:
    replica: int
    end: float  # time.time()
    seconds: float
    status: int
    code: str | None
    retry_after: float | None


class Load:
    """Closed-loop callers: ``SLOTS + QUEUED[i]`` at replica i, plus one that keeps trying the
    full replica 0. A refused caller waits 50 ms before its next call."""

    def __init__(self, pairs: Sequence[Pair]) -> None:
        self._urls = [p.shim.url + "/v1/chat/completions" for p in pairs]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.answers: list[Answer] = []
        plan = [i for i, queued in enumerate(QUEUED) for _ in range(SLOTS + queued)] + [0]
        self._threads = [threading.Thread(target=self._caller, args=(i,), daemon=True) for i in plan]

    def _caller(self, replica: int) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.time()
                response = client.post(self._urls[replica], json=BODY)
                end = time.time()
                code, hint = None, None
                if response.status_code != 200:
                    error = response.json()["error"]
                    code, hint = error.get("code"), error.get("retry_after_seconds")
                with self._lock:
                    self.answers.append(Answer(replica, end, end - start, response.status_code, code, hint))
                if response.status_code != 200:
                    self._stop.wait(0.05)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(35)

    def between(self, start: float, end: float) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if start < a.end <= end]


class Hold:
    """Requests that sit: at replica i, ``SLOTS + QUEUED[i]`` requests whose answers outlast the
    test (``HOLD_TOKENS``), so two hold the slots and the rest wait in the queue. Each is a
    connection that sends its request and reads nothing; closing it on exit is the caller going
    away (the shim cancels the request). Entered once every shim's ``/metrics`` shows the levels."""

    def __init__(self, pairs: Sequence[Pair]) -> None:
        self._pairs = pairs
        self._sockets: list[socket.socket] = []

    def _send(self, url: str) -> None:
        host, port = host_port(url).rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
        self._sockets.append(sock)
        body = json.dumps(HOLD_BODY).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)

    def __enter__(self) -> Hold:
        try:
            for i, pair in enumerate(self._pairs):
                for _ in range(SLOTS + QUEUED[i]):
                    self._send(pair.shim.url)
            for i, pair in enumerate(self._pairs):
                wait_levels(pair.shim.url, SLOTS, QUEUED[i])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for sock in self._sockets:
            sock.close()


@dataclass(frozen=True)
class Levels:
    """One shim's ``/metrics`` at one moment: its levels (all classes together), its drain rate,
    and the count of every way a held request could leave a queue or a slot: admitted to a slot,
    gone, failed, timed out in the queue. Completions are left out (no held request completes
    within the test, and the flowing load's last ones may be counted after their answers, which
    the caller has by then), and so are ``queue_full`` refusals (never entered)."""

    in_flight: float
    queued: float
    drain: float
    moves: dict[tuple[tuple[str, str], ...], float]


def shim_levels(url: str) -> Levels:
    samples = shim_samples(url)

    def total(metric: str) -> float:
        return sum(v for (name, _), v in samples.items() if name == metric)

    moves = {
        labels: v
        for (name, labels), v in samples.items()
        if name == "llm_backoff_shim_requests_total"
        and dict(labels).get("outcome") != "completed"
        and dict(labels).get("code") != "queue_full"
    }
    return Levels(
        total("llm_backoff_shim_in_flight"),
        total("llm_backoff_shim_queue_depth"),
        total("llm_backoff_shim_drain_rate_per_second"),
        moves,
    )


def wait_levels(url: str, in_flight: int, queued: int, timeout: float = 15.0) -> None:
    """Until the shim's own gauges show ``in_flight`` and ``queued``."""
    deadline = time.monotonic() + timeout
    while True:
        levels = shim_levels(url)
        if (levels.in_flight, levels.queued) == (in_flight, queued):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{url}: in flight {levels.in_flight}, queued {levels.queued} after {timeout} s"
            )
        time.sleep(0.02)


def wait_scraped_after(client: PromClient, targets: Sequence[str], moment: float, timeout: float) -> float:
    """Until Prometheus holds a scrape of every target that started after ``moment``
    (``time.time()``); returns when it was seen (every such scrape was stored by then)."""
    client.wait_for(
        "timestamp(up)",
        lambda s: set(targets) <= {x.labels.get("instance") for x in s if x.value > moment},
        timeout=timeout,
        poll=0.05,
    )
    return time.time()


def wait_evaluated_after(client: PromClient, moment: float, timeout: float = 10.0) -> None:
    """Until the recording rules were evaluated at a time after ``moment``: that evaluation read
    every sample Prometheus held at ``moment``, or a later one of the same series."""
    client.wait_for(
        "timestamp(job:llm_backoff_shim_replicas:count)",
        lambda s: bool(s) and s[0].value > moment,
        timeout=timeout,
        poll=0.05,
    )


def shim_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def drain_rate(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return sum(v for (name, _), v in samples.items() if name == "llm_backoff_shim_drain_rate_per_second")


# --------------------------------------------------------------------------- the queries


@dataclass(frozen=True)
class Query:
    source: str  # where it comes from: "keda <trigger>", "grafana <panel> <refId>", "rule <name>"
    expr: str


def grafana_expr(expr: str) -> str:
    """A dashboard query as Grafana sends it: ``$class`` at its default (All: ``.*``, the
    variable's allValue) and ``$__rate_interval`` for a 1 s scrape interval."""
    text = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$class", ".*").replace("${class}", ".*")
    assert "$" not in text, f"a Grafana variable is left in {text!r}"
    return text


def keda_queries() -> list[Query]:
    docs = [d for d in yaml.safe_load_all(KEDA.read_text()) if d]
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    return [Query(f"keda {t['name']}", t["metadata"]["query"]) for t in scaled["spec"]["triggers"]]


def dashboard_queries() -> list[Query]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    return [
        Query(f"grafana {p['title']} {t['refId']}", grafana_expr(t["expr"]))
        for p in panels
        for t in p.get("targets", [])
    ]


def rule_queries() -> list[Query]:
    groups = yaml.safe_load(SHIPPED_RULES.read_text())["groups"]
    out = []
    for group in groups:
        for rule in group["rules"]:
            if "record" in rule:
                out.append(Query(f"rule {rule['record']}", rule["record"]))
            else:
                out.append(Query(f"alert {rule['alert']}", rule["expr"]))
    return out


# --------------------------------------------------------------------------- what the docs say

Values = list[Sample]


@dataclass
class Seen:
    """What the test knows at the moment of evaluation, independently of Prometheus."""

    targets: list[str]  # replica i's instance label
    drain: list[float]  # each shim's drain rate from its own /metrics
    answers: list[Answer]  # answers that ended in the last RATE_WINDOW seconds
    all_answers: list[Answer]  # every answer so far
    max_seconds: float  # the slowest call so far

    def per_second(self, keep: Callable[[Answer], bool]) -> float:
        return sum(1 for a in self.answers if keep(a)) / RATE_WINDOW


def by(samples: Values, label: str) -> dict[str, float]:
    return {s.labels.get(label, ""): s.value for s in samples}


def only(samples: Values) -> float:
    assert len(samples) == 1, samples
    return samples[0].value


#: Tolerance of a rate Prometheus computes against the callers' own counts. A rate is read over
#: a window whose edges fall between scrapes, and on a loaded machine scrapes come late, so a
#: tight band here tests the machine, not the query. Half either way still tells a sum over the
#: replicas from one replica's figure (a third of it), or a rate from a count.
RATE_REL = 0.5


def near(value: float, expected: float, rel: float, what: str) -> None:
    assert math.isfinite(value), f"{what}: {value}"
    assert abs(value - expected) <= rel * max(abs(expected), 1e-9), (
        f"{what}: {value:.4g}, expected {expected:.4g}"
    )


_BUCKETS_WAIT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BUCKETS_TTFB = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BUCKETS_RETRY = (1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120)


def bucket_top(value: float, buckets: Sequence[float]) -> float:
    """Upper bound of the histogram bucket that holds ``value``."""
    return next((b for b in buckets if value <= b), math.inf)


def quantiles_ordered(samples: Values, cls: str, top: float) -> list[float]:
    """The interactive percentiles of a p50/p90/p99 panel: present, positive, below ``top``."""
    values = [by([s], "class")[cls] for s in samples if s.labels.get("class") == cls]
    assert values, samples
    assert all(0 < v <= top for v in values), (values, top)
    return values


def idle_expectation(query: Query, samples: Values, seen: Seen) -> None:
    """The fleet has seen no request yet: gauges and rates 0, percentiles NaN ("No data" in
    Grafana), KEDA's p90 0, no alert, three replicas."""
    name = query.source
    values = [s.value for s in samples]
    if "p50" in name or "p90" in name or "p99" in name or "Queue wait" in name or "first byte" in name \
            or "Retry-After" in name:  # fmt: skip
        if name.startswith("keda"):
            assert values == [0.0], (name, samples)
        else:
            assert values, name
            assert all(math.isnan(v) for v in values), (name, samples)
    elif name.startswith("alert"):
        assert samples == [], (name, samples)
    elif name == "rule job:llm_backoff_shim_replicas:count":
        assert values == [3.0]
    else:
        assert values, name
        assert all(v == 0 for v in values), (name, samples)


#: The levels: checked under the held load (:func:`held_expectation`), not the flowing one.
HELD_LEVELS = (
    "keda queue-depth",
    "rule job:llm_backoff_shim_queue_depth:sum",
    "rule instance:llm_backoff_shim_queue_depth:sum",
    "rule job:llm_backoff_shim_queue_depth_per_replica:avg",
    "rule instance:llm_backoff_shim_time_to_drain_seconds",
    "rule job:llm_backoff_shim_time_to_drain_seconds:max",
    "rule job:llm_backoff_shim_replicas:count",
)


def is_level(query: Query) -> bool:
    return query.source in HELD_LEVELS or query.source.startswith(
        ("grafana Queue depth", "grafana In flight", "grafana Time to drain")
    )


@dataclass
class Held:
    """What the shims' own ``/metrics`` showed before and after the held load's evaluation."""

    targets: list[str]
    drain_before: list[float]  # each shim's drain rate; it only decays while nothing completes
    drain_after: list[float]


def held_expectation(query: Query, samples: Values, held: Held) -> None:
    """What each level query says while every replica has both slots busy and 4, 2, 1 requests
    queued, all held: exactly that, and time to drain = queue / the drain rate of the scrape,
    which lies between the shim's rates before and after."""
    name = query.source
    total_queued = sum(QUEUED)
    instance = {t: i for i, t in enumerate(held.targets)}

    def per_replica(values: dict[str, float]) -> dict[int, float]:
        return {instance[k]: v for k, v in values.items()}

    def drain_time(i: int) -> tuple[float, float]:
        return QUEUED[i] / held.drain_before[i], QUEUED[i] / held.drain_after[i]

    def within(value: float, low: float, high: float) -> bool:
        # The bounds and the value are the same division of the same floats, or not.
        return low * (1 - 1e-12) <= value <= high * (1 + 1e-12)

    if name in ("keda queue-depth", "rule job:llm_backoff_shim_queue_depth:sum"):
        assert only(samples) == total_queued, (name, samples)
    elif name in ("grafana Queue depth by replica A", "rule instance:llm_backoff_shim_queue_depth:sum"):
        assert per_replica(by(samples, "instance")) == dict(enumerate(QUEUED)), (name, samples)
    elif name.startswith("grafana Queue depth"):
        assert by(samples, "class") == {"interactive": total_queued, "batch": 0}, (name, samples)
    elif name.startswith("grafana In flight"):
        assert by(samples, "class") == {"interactive": 3 * SLOTS, "batch": 0}, (name, samples)
    elif name in (
        "grafana Time to drain by replica A",
        "rule instance:llm_backoff_shim_time_to_drain_seconds",
    ):
        got = per_replica(by(samples, "instance"))
        assert set(got) == {0, 1, 2}, (name, samples)
        for i in range(3):
            assert within(got[i], *drain_time(i)), (f"{name} replica {i}", got[i], drain_time(i))
    elif name == "rule job:llm_backoff_shim_time_to_drain_seconds:max":
        low = max(drain_time(i)[0] for i in range(3))
        high = max(drain_time(i)[1] for i in range(3))
        assert within(only(samples), low, high), (name, samples, low, high)
    elif name == "rule job:llm_backoff_shim_replicas:count":
        assert only(samples) == 3
    elif name == "rule job:llm_backoff_shim_queue_depth_per_replica:avg":
        assert math.isclose(only(samples), total_queued / 3, rel_tol=1e-12), (name, samples)
    else:
        raise AssertionError(f"{name} is no level: it belongs to loaded_expectation")


def loaded_expectation(query: Query, samples: Values, seen: Seen) -> None:
    """What each query but the levels says while every replica has both slots busy and its queue
    near 4, 2, 1 requests, and replica 0 refuses a caller who keeps knocking."""
    name = query.source
    completed = seen.per_second(lambda a: a.status == 200)
    refused = seen.per_second(lambda a: a.code == "queue_full")
    decided = [a for a in seen.all_answers]
    share = sum(1 for a in decided if a.code == "queue_full") / len(decided)
    instance = {t: i for i, t in enumerate(seen.targets)}

    def per_replica(values: dict[str, float]) -> dict[int, float]:
        return {instance[k]: v for k, v in values.items()}

    if name == "keda interactive-queue-wait-p90" or name.startswith(
        "rule job_class:llm_backoff_shim_queue_wait"
    ):
        got = by(samples, "class")
        p90 = got.get("interactive", got.get("", math.nan))
        assert 0.01 < p90 <= bucket_top(seen.max_seconds, _BUCKETS_WAIT), (name, samples)
    elif name.startswith("grafana SLO state"):
        assert by(samples, "class") == {"interactive": 0, "batch": 0}  # no --ttft-slo: always green
    elif name.startswith("grafana Rejected share") or name.startswith(
        "rule job:llm_backoff_shim_capacity_rejections"
    ):
        near(only(samples), share, RATE_REL, name)
    elif name.startswith("grafana Queue wait"):
        quantiles_ordered(samples, "interactive", bucket_top(seen.max_seconds, _BUCKETS_WAIT))
        assert math.isnan(by(samples, "class")["batch"])
    elif name.startswith("grafana Time to first byte"):
        # Non-streamed answers: the first byte comes with the end, after the queue wait.
        (value,) = quantiles_ordered(samples, "interactive", bucket_top(seen.max_seconds, _BUCKETS_TTFB))
        assert value >= 0.25
    elif name.startswith("grafana Retry-After"):
        hints = [a.retry_after for a in seen.answers if a.retry_after is not None]
        (value,) = quantiles_ordered(samples, "interactive", math.inf)
        assert hints
        p = 0.5 if name.endswith(" A") else 0.9
        true = sorted(hints)[min(len(hints) - 1, int(p * len(hints)))]
        # The callers' hints are the whole load's; the query reads the last window of it, and
        # interpolates inside a bucket: a bucket either side of the true one is the same answer.
        edges = (0.0, *_BUCKETS_RETRY, math.inf)
        at = edges.index(bucket_top(true, _BUCKETS_RETRY))
        bottom, top = edges[max(0, at - 2)], edges[min(len(edges) - 1, at + 1)]
        assert bottom <= value <= top, (name, value, true)
    elif name.startswith("grafana Requests by outcome"):
        got = {(s.labels["class"], s.labels["outcome"]): s.value for s in samples}
        near(got[("interactive", "completed")], completed, RATE_REL, name + " completed")
        near(got[("interactive", "admitted")], completed, RATE_REL, name + " admitted")
        near(got[("interactive", "rejected")], refused, RATE_REL, name + " rejected")
        assert got[("interactive", "upstream_error")] == 0
        assert all(v == 0 for (cls, _), v in got.items() if cls == "batch")
    elif name.startswith("grafana Rejections by reason"):
        got = by(samples, "code")
        near(got["queue_full"], refused, RATE_REL, name)
        assert all(v == 0 for code, v in got.items() if code != "queue_full"), got
    elif name.startswith("grafana Drain rate"):
        got = by(samples, "class")
        near(got["interactive"], sum(seen.drain), RATE_REL, name)  # the fleet's, not one replica's
        assert got["batch"] == 0
    elif name == "rule instance:llm_backoff_shim_drain_rate_per_second:sum":
        got = per_replica(by(samples, "instance"))
        for i in range(3):
            near(got[i], seen.drain[i], RATE_REL, f"{name} replica {i}")
    elif name == "alert LlmBackoffFleetShedding":
        # The full replica refuses: the expression holds (the alert fires after its `for`).
        assert only(samples) > 0.05, samples
    elif name.startswith("alert"):
        assert samples == [], (name, samples)
    else:
        raise AssertionError(f"no expectation for {name}: add one with what docs/deploy.md says it shows")


# --------------------------------------------------------------------------- the test


SHOWN = ("class", "code", "outcome", "instance")


def _show(samples: Values) -> str:
    return (
        ", ".join(
            f"{'/'.join(v for k, v in sorted(s.labels.items()) if k in SHOWN)}={s.value:.3g}"
            for s in samples
            if not (s.value == 0 and len(samples) > 3)
        )
        or "(empty)"
    )


def report(queries: Sequence[Query], idle: dict[str, Values], loaded: dict[str, Values]) -> None:
    """Each query's value idle and loaded (shown with ``pytest -s``; docs/deploy.md quotes it)."""
    for query in queries:
        before, during = _show(idle[query.source]), _show(loaded[query.source])
        print(f"{query.source}\n    idle:   {before}\n    loaded: {during}")


def evaluate(client: PromClient, queries: Sequence[Query], at: float) -> dict[str, Values]:
    return {q.source: client.query(q.expr, at) for q in queries}


def test_every_keda_and_grafana_query_says_what_the_docs_say_idle_and_loaded(
    fleet: tuple[list[Pair], PrometheusServer],
) -> None:
    pairs, prometheus = fleet
    client = prometheus.client
    queries = keda_queries() + dashboard_queries() + rule_queries()
    assert len(queries) >= 2 + 15 + 13
    targets = [p.target for p in pairs]
    levels = [q for q in queries if is_level(q)]
    assert len(levels) == len(HELD_LEVELS) + 4

    # Idle: two scrapes in the rate window, so rates are 0 rather than absent, and the rules
    # evaluated on them.
    client.wait_for(
        "count(count_over_time(llm_backoff_shim_in_flight[4s]) >= 2)", lambda s: s == [Sample({}, 6.0)]
    )
    wait_evaluated_after(client, time.time())
    at = time.time()
    idle = Seen(targets, [drain_rate(shim_samples(p.shim.url)) for p in pairs], [], [], 0.0)
    idle_results = evaluate(client, queries, at)
    for query in queries:
        idle_expectation(query, idle_results[query.source], idle)

    with Load(pairs) as load:
        # Until a scrape sees every queue full to its design, then a whole rate window of
        # scrapes of it, and the rules evaluated on the last of them.
        client.wait_for(
            "sum(llm_backoff_shim_queue_depth)", lambda s: bool(s) and s[0].value >= sum(QUEUED), timeout=15
        )
        scraped = wait_scraped_after(client, targets, time.time() + RATE_WINDOW, timeout=RATE_WINDOW + 10)
        wait_evaluated_after(client, scraped)
        at = time.time()
        drains = [drain_rate(shim_samples(p.shim.url)) for p in pairs]
        results = evaluate(client, queries, at)
        answers = load.between(0, at)
        seen = Seen(
            targets, drains, load.between(at - RATE_WINDOW, at), answers, max(a.seconds for a in answers)
        )

    with Hold(pairs):
        # Every shim shows its levels (Hold waited for them): from here until the check below,
        # nothing may leave a queue or a slot.
        before = [shim_levels(p.shim.url) for p in pairs]
        scraped = wait_scraped_after(client, targets, time.time(), timeout=10)
        wait_evaluated_after(client, scraped)
        held_at = time.time()
        held_results = evaluate(client, levels, held_at)
        after = [shim_levels(p.shim.url) for p in pairs]
    for i, (first, last) in enumerate(zip(before, after, strict=True)):
        for shown in (first, last):
            assert (shown.in_flight, shown.queued) == (SLOTS, QUEUED[i]), (i, shown)
        assert last.moves == first.moves, (i, first.moves, last.moves)  # no request moved
    held = Held(targets, [b.drain for b in before], [a.drain for a in after])

    loaded = {**results, **held_results}
    report(queries, idle_results, loaded)
    done = sorted(a.seconds for a in seen.answers if a.status == 200)
    print(
        f"callers in the last {RATE_WINDOW:g} s: {len(done)} completed, latency p50/p90/p99 "
        + "/".join(f"{done[min(len(done) - 1, int(p * len(done)))]:.2f}" for p in (0.5, 0.9, 0.99))
        + f" s; shims' drain rates now {', '.join(f'{d:.2f}' for d in drains)}/s"
    )
    failures = []
    for query in queries:
        try:
            if is_level(query):
                held_expectation(query, held_results[query.source], held)
            else:
                loaded_expectation(query, results[query.source], seen)
        except AssertionError as exc:
            failures.append(f"{query.source}: {query.expr}\n    {exc}")
    assert not failures, "\n".join(failures)
    # The percentile panels' lines are ordered as their legends say: p50 <= p90 (<= p99).
    lines: dict[str, list[float]] = {}
    for query in queries:
        if query.source.startswith("grafana") and "(p50 /" in query.source:
            panel = query.source.rsplit(" ", 1)[0]
            lines.setdefault(panel, []).append(by(results[query.source], "class")["interactive"])
    assert len(lines) == 3
    for panel, values in lines.items():
        assert values == sorted(values), (panel, values)
    assert all(r["health"] == "ok" for r in client.rules()), client.rules()

    # Load gone (the held requests' callers went away): the levels fall back to zero within a
    # scrape or two.
    for expr in (
        "job:llm_backoff_shim_queue_depth:sum",
        "max(instance:llm_backoff_shim_time_to_drain_seconds)",
        "sum(llm_backoff_shim_in_flight)",
    ):
        client.wait_for(expr, lambda s: [x.value for x in s] == [0.0], timeout=10)


def test_keda_queries_read_a_fleet_scraped_by_the_shipped_static_config() -> None:
    """The documented VM setup: Prometheus scrapes the shims as ``prometheus.yml`` does (its
    job, no ``namespace`` label). KEDA's queries still read the fleet: the queue depth the
    shims hold, and the p90 of the queue waits they just gave (not the idle 0)."""
    _need_prometheus()
    pairs = start_pairs(3, SIM_FLAGS, SHIM_FLAGS)
    targets = [p.target for p in pairs]
    try:
        with PrometheusServer(targets, scrape_interval=SCRAPE) as prometheus:
            client = prometheus.client
            client.wait_up(targets)
            assert {s.labels.get("job") for s in client.query("up")} == {"llm-backoff-shim"}
            assert not [s for s in client.query("up") if "namespace" in s.labels]
            # Queue waits: at each replica, two calls beyond its two slots wait for a slot.
            urls = [p.shim.url + "/v1/chat/completions" for p in pairs for _ in range(SLOTS + 2)]
            with ThreadPoolExecutor(len(urls)) as pool:
                answers = list(pool.map(lambda url: httpx.post(url, json=BODY, timeout=30), urls))
            assert [a.status_code for a in answers] == [200] * len(urls)
            waits = [int(a.headers["x-queue-time-ms"]) / 1000 for a in answers]
            with Hold(pairs):
                scraped = wait_scraped_after(client, targets, time.time(), timeout=10)
                at = max(scraped, time.time())
                results = {q.source: client.query(q.expr, at) for q in keda_queries()}
                after = [shim_levels(p.shim.url) for p in pairs]
            assert [(a.in_flight, a.queued) for a in after] == [(SLOTS, q) for q in QUEUED]
            assert only(results["keda queue-depth"]) == sum(QUEUED)
            p90 = only(results["keda interactive-queue-wait-p90"])
            # The histogram's p90 (any admission in the window makes it positive), not the 0 that
            # `or vector(0)` gives a query that matches no series.
            assert 0 < p90 <= bucket_top(max(waits), _BUCKETS_WAIT), (p90, waits)
    finally:
        for pair in pairs:
            pair.shim.close()
            pair.sim.close()
