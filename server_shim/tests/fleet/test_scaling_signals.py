"""The scaling signals, evaluated by a real Prometheus scraping three shims on loopback.

Every query in the KEDA ScaledObject and the Grafana dashboard (read from the files, Grafana's
variables substituted explicitly), every recorded series and every alert expression of the shipped
rules is evaluated while the fleet is idle and while it is loaded, and checked against what
docs/deploy.md says it is. The load is a known one: closed-loop callers keep each replica's two
slots busy and its queue at 4, 2 and 1 requests, and one more caller keeps knocking on the full
replica (refused with ``queue_full``). Expected values come from that design and from what the
callers and the shims' own ``/metrics`` saw at the same moment, never from Prometheus itself.

Bounded: three simulator+shim pairs, scrape and rule evaluation every second, about 15 s in all.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
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
SERVICE_TOKENS = 20
SIM_FLAGS = (
    "--max-num-seqs", "4", "--ttft", "0.02", "--itl", "0.02", "--itl-batch-factor", "0",
    "--output-tokens", str(SERVICE_TOKENS), "--output-tokens-sigma", "0", "--seed", "3",
)  # fmt: skip
SHIM_FLAGS = (
    "--max-concurrency", str(SLOTS), "--max-queue", str(MAX_QUEUE), "--max-queue-wait", "30",
)  # fmt: skip
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": SERVICE_TOKENS}

pytestmark = pytest.mark.timeout(90)


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
                record = rule["record"]
                if "queue_depth" in record:
                    # A level the callers hold by re-sending: in one evaluation a queue can be
                    # caught between a call's end and its caller's next one (seen on a loaded
                    # CI machine: 2 read as 0). The median of what the rule recorded over the
                    # rate window is the level the load was designed to hold.
                    record = f"quantile_over_time(0.5, {record}[{RATE_INTERVAL}])"
                out.append(Query(f"rule {rule['record']}", record))
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


def loaded_expectation(query: Query, samples: Values, seen: Seen) -> None:
    """What each query says while every replica has both slots busy and 4, 2, 1 requests queued."""
    name = query.source
    total_queued = sum(QUEUED)
    completed = seen.per_second(lambda a: a.status == 200)
    refused = seen.per_second(lambda a: a.code == "queue_full")
    decided = [a for a in seen.all_answers]
    share = sum(1 for a in decided if a.code == "queue_full") / len(decided)
    instance = {t: i for i, t in enumerate(seen.targets)}

    def per_replica(values: dict[str, float]) -> dict[int, float]:
        return {instance[k]: v for k, v in values.items()}

    def queue_by_replica(values: dict[str, float]) -> None:
        got = per_replica(values)
        assert set(got) == {0, 1, 2}, values
        for i, queued in enumerate(QUEUED):
            assert queued - 1 <= got[i] <= queued, (name, got)

    def time_to_drain(values: dict[str, float], dips: int) -> None:
        """Each replica's queue over its drain rate; ``dips``: how far below its level a queue
        may be caught in the one evaluation read (a caller between two calls; the median over
        a window, as for the recorded queue depths, is no help here: the drain rate's average
        was still rising over the window)."""
        got = per_replica(values)
        for i, queued in enumerate(QUEUED):
            low, high = max(0, queued - dips) / seen.drain[i], queued / seen.drain[i]
            assert low * (1 - RATE_REL) <= got[i] <= high * (1 + RATE_REL), (
                f"{name} replica {i}",
                got,
                low,
                high,
            )
        assert got[0] > got[2], got

    if name == "keda queue-depth" or name == "rule job:llm_backoff_shim_queue_depth:sum":
        assert total_queued - 2 <= only(samples) <= total_queued, (name, samples)
    elif name == "keda interactive-queue-wait-p90" or name.startswith(
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
    elif name.startswith("grafana In flight"):
        assert by(samples, "class") == {"interactive": 3 * SLOTS, "batch": 0}
    elif (
        name.startswith("grafana Queue depth by replica")
        or name == "rule instance:llm_backoff_shim_queue_depth:sum"
    ):
        queue_by_replica(by(samples, "instance"))
    elif name.startswith("grafana Queue depth"):
        got = by(samples, "class")
        assert got["batch"] == 0
        assert total_queued - 2 <= got["interactive"] <= total_queued, got
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
    elif name.startswith("grafana Time to drain by replica"):
        # An instant read, like the queue-depth panel: a queue may be caught one below its
        # level (a caller between its answer and its next call).
        time_to_drain(by(samples, "instance"), dips=1)
    elif name == "rule instance:llm_backoff_shim_time_to_drain_seconds":
        time_to_drain(by(samples, "instance"), dips=2)
    elif name == "rule job:llm_backoff_shim_time_to_drain_seconds:max":
        # The longest of the three: replica 0's (queue 4), even caught two below its level.
        got = only(samples)
        assert (
            (QUEUED[0] - 2) / seen.drain[0] * (1 - RATE_REL)
            <= got
            <= QUEUED[0] / seen.drain[0] * (1 + RATE_REL)
        )
    elif name == "rule job:llm_backoff_shim_replicas:count":
        assert only(samples) == 3
    elif name == "rule job:llm_backoff_shim_queue_depth_per_replica:avg":
        assert (total_queued - 2) / 3 <= only(samples) <= total_queued / 3
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

    # Idle: two scrapes in the rate window, so rates are 0 rather than absent.
    client.wait_for(
        "count(count_over_time(llm_backoff_shim_in_flight[4s]) >= 2)", lambda s: s == [Sample({}, 6.0)]
    )
    time.sleep(SCRAPE)
    at = time.time()
    idle = Seen(targets, [drain_rate(shim_samples(p.shim.url)) for p in pairs], [], [], 0.0)
    idle_results = evaluate(client, queries, at)
    for query in queries:
        idle_expectation(query, idle_results[query.source], idle)

    with Load(pairs) as load:
        # Until a scrape sees every queue full to its design, then a whole rate window of it.
        client.wait_for(
            "sum(llm_backoff_shim_queue_depth)", lambda s: bool(s) and s[0].value >= sum(QUEUED), timeout=15
        )
        time.sleep(RATE_WINDOW + SCRAPE)
        at = time.time()
        drains = [drain_rate(shim_samples(p.shim.url)) for p in pairs]
        results = evaluate(client, queries, at)
        answers = load.between(0, at)
        seen = Seen(
            targets, drains, load.between(at - RATE_WINDOW, at), answers, max(a.seconds for a in answers)
        )
    report(queries, idle_results, results)
    done = sorted(a.seconds for a in seen.answers if a.status == 200)
    print(
        f"callers in the last {RATE_WINDOW:g} s: {len(done)} completed, latency p50/p90/p99 "
        + "/".join(f"{done[min(len(done) - 1, int(p * len(done)))]:.2f}" for p in (0.5, 0.9, 0.99))
        + f" s; shims' drain rates now {', '.join(f'{d:.2f}' for d in drains)}/s"
    )
    failures = []
    for query in queries:
        try:
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

    # Load gone: the levels fall back to zero within a scrape or two.
    for expr in (
        "job:llm_backoff_shim_queue_depth:sum",
        "max(instance:llm_backoff_shim_time_to_drain_seconds)",
        "sum(llm_backoff_shim_in_flight)",
    ):
        client.wait_for(expr, lambda s: [x.value for x in s] == [0.0], timeout=10)
