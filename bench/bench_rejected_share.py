"""Does the fleet's rejected share say what callers saw? Three simulated engines, a shim each
sharing the fleet's record in Redis (``--fleet-retry-after``), behind nginx and HAProxy with
the shipped configurations, a real Prometheus with the shipped rules, and about twice the
fleet's capacity offered for ``--seconds``.

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_rejected_share.py   # ~3 min

Callers, in equal shares: plain httpx (one attempt per call), httpx retrying a refusal after
its Retry-After with the same ``X-Request-Id`` (each retry a new attempt the load balancer
stamps anew), and openai wrapped by the SDK's interactive preset (no id: the load balancer
gives each attempt one). Every HTTP attempt a caller makes is counted at its transport. At the
end, after a scrape of every shim that followed the last answer and a rule evaluation after
that, it prints for each load balancer: the callers' refused share (refused attempts over
attempts), the shipped rule ``job:llm_backoff_shim_capacity_rejections:ratio_rate5m``, the
same rule as it read before the fleet counted attempts (tries), and the shims' own counters.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import httpx
import httpx2
import openai
from prometheus_client.parser import text_string_to_metric_families

import llm_backoff
from llm_backoff_shim.lab.fleet import Fleet
from llm_backoff_shim.lab.fleet_configs import lb_binary
from llm_backoff_shim.lab.prometheus import PrometheusServer

RULE = "job:llm_backoff_shim_capacity_rejections:ratio_rate5m"
CAPACITY = 'code=~"queue_full|queue_timeout|slo_shed"'
#: The rule as shipped before the shims counted attempts: refused tries over decided tries.
TRIES_RULE = (
    f'sum(rate(llm_backoff_shim_requests_total{{outcome="rejected",{CAPACITY}}}[5m]))'
    ' / clamp_min(sum(rate(llm_backoff_shim_requests_total{outcome=~"admitted|rejected"}[5m])), 1e-9)'
)
SIM_FLAGS = ("--max-num-seqs", "8", "--ttft", "0.02", "--itl", "0.01", "--itl-batch-factor", "0",
             "--output-tokens", "40", "--output-tokens-sigma", "0.3")  # fmt: skip
SHIM_FLAGS = ("--max-concurrency", "2", "--max-queue", "2", "--max-queue-wait", "1")
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
REFUSED = (429, 503)


class Counting(httpx.BaseTransport):
    """Counts every HTTP attempt's status (beneath the SDK's retries)."""

    def __init__(self, inner: httpx.BaseTransport, seen: Counter[str], lock: threading.Lock) -> None:
        self._inner, self._seen, self._lock = inner, seen, lock

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        count(self._seen, self._lock, response.status_code)
        return response

    def close(self) -> None:
        self._inner.close()


class Counting2(httpx2.BaseTransport):
    """:class:`Counting` for httpx2 (openai 3's HTTP library)."""

    def __init__(self, inner: httpx2.BaseTransport, seen: Counter[str], lock: threading.Lock) -> None:
        self._inner, self._seen, self._lock = inner, seen, lock

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._inner.handle_request(request)
        count(self._seen, self._lock, response.status_code)
        return response

    def close(self) -> None:
        self._inner.close()


def count(seen: Counter[str], lock: threading.Lock, status: int) -> None:
    with lock:
        seen["refused" if status in REFUSED else str(status)] += 1


def redis_server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        cwd=tempfile.gettempdir(),
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0?socket_timeout=5"


def shim_totals(urls: list[str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                name = s.name.removeprefix("llm_backoff_shim_").removesuffix("_total")
                if name in ("requests", "attempts") and s.labels["outcome"] in ("admitted", "rejected"):
                    out[f"{name} {s.labels['outcome']}"] += int(s.value)
                elif name == "rescues":
                    out["rescues"] += int(s.value)
    return out


def run(lb: str, redis_url: str, seconds: float, rate: float, seed: int) -> dict[str, Any]:
    flags = (*SHIM_FLAGS, "--fleet-retry-after", "--redis-url", redis_url)
    seen: Counter[str] = Counter()
    lock = threading.Lock()
    with Fleet(3, lb, sim_flags=SIM_FLAGS, shim_flags=flags) as fleet:
        targets = [r.address for r in fleet.replicas]
        prometheus = PrometheusServer(targets, scrape_interval=1.0)
        with prometheus:
            prometheus.client.wait_up(targets)
            base = httpx.HTTPTransport()
            plain = httpx.Client(base_url=fleet.url, transport=Counting(base, seen, lock), timeout=30)
            sdk = llm_backoff.wrap(
                openai.OpenAI(
                    base_url=fleet.url + "/v1",
                    api_key="unused",
                    http_client=httpx2.Client(
                        transport=Counting2(httpx2.HTTPTransport(), seen, lock), timeout=30
                    ),
                    max_retries=0,
                ),
                request_class="interactive",
            )

            def plain_call(k: int, retries: int) -> None:
                headers = {"x-request-id": f"c{seed}-{k}"}
                for _ in range(retries + 1):
                    r = plain.post("/v1/chat/completions", json=BODY, headers=headers)
                    if r.status_code not in REFUSED:
                        return
                    time.sleep(min(2.0, float(r.headers.get("retry-after-ms", 1000)) / 1000))

            def sdk_call() -> None:
                with contextlib.suppress(openai.APIError):
                    sdk.chat.completions.create(
                        model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=40
                    )

            rng = random.Random(seed)
            start = time.monotonic()
            with cf.ThreadPoolExecutor(96) as pool:
                futures = []
                at, k = 0.0, 0
                while at < seconds:
                    at += rng.expovariate(rate)
                    time.sleep(max(0.0, start + at - time.monotonic()))
                    kind = k % 3
                    if kind == 0:
                        futures.append(pool.submit(plain_call, k, 0))
                    elif kind == 1:
                        futures.append(pool.submit(plain_call, k, 2))
                    else:
                        futures.append(pool.submit(sdk_call))
                    k += 1
                for f in futures:
                    f.result()
            done = time.time()
            client = prometheus.client
            client.wait_for(
                "timestamp(up)",
                lambda s: set(targets) <= {x.labels.get("instance") for x in s if x.value > done},
                timeout=15,
            )
            after = time.time()
            client.wait_for(f"timestamp({RULE})", lambda s: bool(s) and s[0].value > after, timeout=15)
            at_ = time.time()
            rule = client.query(RULE, at_)
            tries = client.query(TRIES_RULE, at_)
            totals = shim_totals(fleet.shim_urls)
            plain.close()
    attempts = sum(seen.values())
    return {
        "lb": lb,
        "calls": k,
        "attempts": attempts,
        "refused": seen["refused"],
        "callers_share": seen["refused"] / attempts,
        "rule": rule[0].value if rule else float("nan"),
        "tries_rule": tries[0].value if tries else float("nan"),
        "shims": dict(totals),
        "statuses": dict(seen),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--rate", type=float, default=20.0, help="calls per second (capacity ~11/s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lb", nargs="*", default=["nginx", "haproxy"])
    args = parser.parse_args(argv)
    proc, url = redis_server()
    try:
        for lb in args.lb:
            if lb_binary(lb) is None:
                print(f"{lb}: not installed, skipped")
                continue
            r = run(lb, url, args.seconds, args.rate, args.seed)
            print(
                f"{lb}: {r['calls']} calls, {r['attempts']} attempts, {r['refused']} refused: callers' share "
                f"{r['callers_share']:.3f}; rule {r['rule']:.3f} (counting tries: {r['tries_rule']:.3f}); "
                f"shims {r['shims']}; statuses {r['statuses']}",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
