"""Rolling restarts and a dead engine behind a real nginx and a real HAProxy, under modest load.

Three simulated engines with a shim each (two slots, a short queue) behind the load balancer
running the shipped configuration. Callers: two using the SDK (``llm_backoff.wrap``, a 20 s
deadline, whole answers) and two plain openai clients (two retries, streaming). While they
call, one replica's shim gets SIGTERM and is started again, then another replica's engine is
killed (SIGKILL) and started again. Between steps the test waits until the callers have been
served a few more calls, not for a set time, so every stage sees calls on any machine. Checked:

- no SDK call fails (each had most of its deadline left);
- a plain openai call fails only if it was mid-stream on the killed engine (its answer had
  begun before the error), at most as many as that replica had slots;
- each replica serves calls again once it answers; with HAProxy its runtime API shows the
  replica DOWN after its /ready failed and UP again after it answers.

And HAProxy itself reloaded the documented way (master-worker, SIGUSR2) with a stream and a
whole answer in flight: both end whole.

How long each step took (from this test's own clock) is printed (``pytest -s``), never
asserted: the machine is shared. Bounded: about 15 s per load balancer, loopback only.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from llm_backoff_shim.lab.fleet import Fleet

pytestmark = pytest.mark.timeout(180)

SIM_FLAGS = (
    "--ttft", "0", "--itl", "0.01", "--itl-batch-factor", "0", "--prefill-time-per-token", "0",
    "--output-tokens", "1000", "--output-tokens-sigma", "0",
)  # fmt: skip
SHIM_FLAGS = ("--max-concurrency", "2", "--max-queue", "4", "--log-level", "info", "--log-format", "json")
TOKENS = 30  # 0.3 s a call


@pytest.fixture(params=["nginx", "haproxy"])
def fleet(request: pytest.FixtureRequest, need: Callable[[str], None]) -> Iterator[Fleet]:
    lb: str = request.param
    need(lb)
    with Fleet(3, lb, sim_flags=SIM_FLAGS, shim_flags=SHIM_FLAGS) as started:
        yield started


@dataclass
class Callers:
    """Closed-loop callers of one kind; what each call ended with."""

    served: int = 0
    #: time, chunks seen, whether the answer had begun (its head arrived), error
    failures: list[tuple[float, int, bool, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, call: Callable[[], int], stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                call()
            except Exception as exc:  # every failure is counted, with its kind
                chunks = exc.chunks if isinstance(exc, MidStreamError) else 0
                began = exc.began if isinstance(exc, MidStreamError) else False
                with self.lock:
                    self.failures.append(
                        (time.monotonic(), chunks, began, f"{type(exc).__name__}: {exc}"[:200])
                    )
                continue
            with self.lock:
                self.served += 1


class Watch:
    """Samples each replica's /ready (and HAProxy's view of it) every 50 ms, with times."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.samples: list[tuple[float, list[int], list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=1) as client:
            while not self._stop.is_set():
                ready = []
                for url in self.fleet.shim_urls:
                    try:
                        ready.append(client.get(f"{url}/ready").status_code)
                    except httpx.HTTPError:
                        ready.append(0)  # no answer: the shim is down or not listening
                lb = self.fleet.lb
                states = lb.server_states() if lb is not None and lb.lb == "haproxy" else []
                self.samples.append((time.monotonic(), ready, states))
                time.sleep(0.05)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def first(self, after: float, test: Callable[[list[int], list[str]], bool], timeout: float = 10) -> float:
        """Seconds from ``after`` to the first sample passing ``test`` (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, ready, states in list(self.samples):
                if t >= after and test(ready, states):
                    return t - after
            time.sleep(0.05)
        raise AssertionError(f"not seen within {timeout} s")


def served_since(fleet: Fleet, i: int, wall: float, timeout: float = 10) -> float:
    """Seconds from ``wall`` (epoch) to the arrival of the first call replica ``i`` served after it."""
    from datetime import datetime

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in fleet.access_records(i):
            end = datetime.fromisoformat(r["time"]).timestamp()
            arrival = end - r["total_ms"] / 1000
            if r["outcome"] == "completed" and arrival >= wall:
                return arrival - wall
        time.sleep(0.1)
    raise AssertionError(f"replica {i} served nothing within {timeout} s")


def nginx_tries(fleet: Fleet, i: int) -> list[tuple[float, str]]:
    """(time, upstream status) of every try nginx made at replica ``i``, from its access log
    (``lab.fleet_configs.nginx_main_config``'s format: the tries of a call are listed in order)."""
    address = fleet.replicas[i].address
    tries = []
    for line in fleet.lb_log().splitlines():
        if " up=" not in line or " upstatus=" not in line:
            continue
        ups = line.split("up=", 1)[1].split(" upstatus=")[0].split(", ")
        statuses = line.split("upstatus=", 1)[1].split(" rt=")[0].split(", ")
        tries += [(float(line.split()[0]), s) for a, s in zip(ups, statuses, strict=False) if a == address]
    return tries


def test_rolling_restart_and_dead_engine_lose_no_call(fleet: Fleet) -> None:
    openai = pytest.importorskip("openai")
    from llm_backoff import RetryPolicy, wrap

    lb = fleet.lb_name
    messages = [{"role": "user", "content": "hi"}]
    stop = threading.Event()
    sdk, plain = Callers(), Callers()

    def sdk_call(client: Any) -> Callable[[], int]:
        def call() -> int:
            client.chat.completions.create(model="sim-model", messages=messages, max_tokens=TOKENS)
            return 1

        return call

    threads = []
    for _ in range(2):
        s = wrap(openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x"), RetryPolicy(deadline=20))
        threads.append(threading.Thread(target=sdk.run, args=(sdk_call(s), stop), daemon=True))
        p = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=2)
        threads.append(
            threading.Thread(target=plain.run, args=(plain_stream(p, messages), stop), daemon=True)
        )
    steps: dict[str, float] = {}

    def load_goes_on(calls: int = 4, timeout: float = 30) -> None:
        """Until the callers have been served ``calls`` more calls (``timeout`` only bounds a
        broken run): each step below happens under load, and calls are made at every stage."""
        with sdk.lock, plain.lock:
            target = sdk.served + plain.served + calls
        deadline = time.monotonic() + timeout
        while sdk.served + plain.served < target:
            assert time.monotonic() < deadline, f"served {sdk.served} + {plain.served}, waiting for {target}"
            time.sleep(0.02)

    with Watch(fleet) as watch:
        for t in threads:
            t.start()
        load_goes_on()

        # A rolling restart of replica 0's shim.
        t0 = time.monotonic()
        steps["shim 0: SIGTERM to exit (drained)"] = fleet.stop_shim(0)
        wall0 = time.time()  # from here to wall1 nothing listens on shim 0's port
        steps["shim 0: SIGTERM to /ready unanswered"] = watch.first(t0, lambda r, s: r[0] != 200)
        if lb == "haproxy":
            steps["shim 0: SIGTERM to HAProxy DOWN"] = watch.first(t0, lambda r, s: s[0] == "DOWN")
        load_goes_on()  # served by the other replicas while shim 0 is down
        t1, wall1 = time.monotonic(), time.time()
        steps["shim 0: start to /health"] = fleet.start_shim(0)
        steps["shim 0: start to /ready 200"] = watch.first(t1, lambda r, s: r[0] == 200)
        if lb == "haproxy":
            steps["shim 0: start to HAProxy UP"] = watch.first(t1, lambda r, s: s[0] == "UP")
        steps["shim 0: start to first call served"] = served_since(fleet, 0, wall1)

        # Replica 1's engine crashes and comes back.
        load_goes_on()
        t2 = time.monotonic()
        fleet.kill_engine(1)
        wall2 = time.time()
        # 503 as a rule; any failure counts (a loaded machine once let 10 s pass without a 503
        # sample: the probe's own 1 s timeout reads as 0), and the wait allows for such a machine.
        steps["engine 1: SIGKILL to shim's /ready failing"] = watch.first(
            t2, lambda r, s: r[1] != 200, timeout=20
        )
        if lb == "haproxy":
            steps["engine 1: SIGKILL to HAProxy DOWN"] = watch.first(t2, lambda r, s: s[1] == "DOWN")
        load_goes_on()  # served by the other replicas while engine 1 is down
        t3, wall3 = time.monotonic(), time.time()
        steps["engine 1: start to its /health"] = fleet.start_engine(1)
        steps["engine 1: start to shim's /ready 200"] = watch.first(t3, lambda r, s: r[1] == 200)
        if lb == "haproxy":
            steps["engine 1: start to HAProxy UP"] = watch.first(t3, lambda r, s: s[1] == "UP")
        steps["engine 1: start to first call served"] = served_since(fleet, 1, wall3)
        load_goes_on()
        stop.set()
        for t in threads:
            t.join(30)

    print(f"\n{lb}: SDK {sdk.served} served, {len(sdk.failures)} failed; plain openai {plain.served} served,")
    print(f"  {len(plain.failures)} failed: {[(round(t - t2, 2), n, e) for t, n, _, e in plain.failures]}")
    for name, seconds in steps.items():
        print(f"  {name}: {seconds:.2f} s")
    if lb == "nginx":
        # nginx OSS has no active checks: calls still try a stopped replica (a refused connect,
        # then the next one) or a replica whose engine is down (its shim's 503, then the next).
        down0 = [s for t, s in nginx_tries(fleet, 0) if wall0 <= t < wall1]
        down1 = [s for t, s in nginx_tries(fleet, 1) if wall2 <= t < wall3]
        print(f"  tries at shim 0 after it exited, before it started: {len(down0)} {sorted(set(down0))}")
        print(f"  tries at replica 1 while its engine was down: {len(down1)} {sorted(set(down1))}")
    assert sdk.served > 0
    assert plain.served > 0
    assert sdk.failures == []
    # Plain callers fail only on a stream cut by the crash: the answer had begun (its head
    # relayed; the cut may come before the first chunk), right after the kill, no more than
    # replica 1 had calls in flight.
    assert all(began for _, _, began, _ in plain.failures), plain.failures
    assert all(t2 <= t <= t3 for t, _, _, _ in plain.failures), plain.failures
    assert len(plain.failures) <= 2


def plain_stream(client: Any, messages: list[dict[str, str]]) -> Callable[[], int]:
    """A streamed call whose chunk count is kept when the stream breaks (as the error's note)."""

    def call() -> int:
        n, began = 0, False
        try:
            stream = client.chat.completions.create(
                model="sim-model", messages=messages, max_tokens=TOKENS, stream=True
            )
            began = True
            for _ in stream:
                n += 1
        except Exception as exc:
            raise MidStreamError(n, began, exc) from exc
        return n

    return call


class MidStreamError(Exception):
    def __init__(self, chunks: int, began: bool, cause: BaseException) -> None:
        super().__init__(f"after {chunks} chunks (begun: {began}): {type(cause).__name__}: {cause}")
        self.chunks = chunks
        self.began = began


def test_an_haproxy_reload_keeps_the_calls_in_flight(need: Callable[[str], None], tmp_path: Path) -> None:
    """The documented way to apply a new HAProxy configuration (docs/deploy.md): HAProxy in
    master-worker mode (`haproxy -W`, as Debian's unit runs it) reloaded with SIGUSR2 while a
    stream and a whole answer are in flight through it. Both end whole: the old worker finishes
    them while the new one takes new calls (one is served during the reload)."""
    need("haproxy")
    with Fleet(1, "haproxy", sim_flags=SIM_FLAGS, shim_flags=SHIM_FLAGS) as fleet:
        assert fleet.lb is not None
        port = free_port()
        text = fleet.lb.config_path.read_text()
        text = re.sub(r"(?m)^(\s*)bind \S+", rf"\g<1>bind 127.0.0.1:{port}", text)
        text = re.sub(r"(?m)^(\s*)stats socket \S+", rf"\g<1>stats socket {tmp_path / 'mw.sock'}", text)
        config = tmp_path / "haproxy.cfg"
        config.write_text(text)
        url = f"http://127.0.0.1:{port}"
        with (tmp_path / "haproxy.log").open("wb") as log:
            master = subprocess.Popen(["haproxy", "-W", "-db", "-f", str(config)], stdout=log, stderr=log)
        try:
            wait_for(lambda: _answers(f"{url}/lb/health"))
            wait_for(lambda: _answers(f"{url}/v1/models"))  # the replica is up in HAProxy's view
            request = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 100,
            }
            started = threading.Event()
            results: dict[str, Any] = {}

            def stream() -> None:
                got = b""
                try:
                    with httpx.stream(
                        "POST", f"{url}/v1/chat/completions", json={**request, "stream": True}, timeout=30
                    ) as r:
                        for chunk in r.iter_bytes():
                            got += chunk
                            started.set()
                    results["stream"] = (r.status_code, got)
                except httpx.HTTPError as exc:  # a cut stream: the failure this test looks for
                    results["stream"] = (type(exc).__name__, got)

            def whole() -> None:
                try:
                    r = httpx.post(f"{url}/v1/chat/completions", json=request, timeout=30)
                    results["whole"] = (r.status_code, r.json())
                except httpx.HTTPError as exc:
                    results["whole"] = (type(exc).__name__, None)

            threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
            for t in threads:
                t.start()
            assert started.wait(10), "the stream never began"
            master.send_signal(signal.SIGUSR2)
            during = httpx.post(f"{url}/v1/chat/completions", json={**request, "max_tokens": 2}, timeout=30)
            for t in threads:
                t.join(30)
        finally:
            master.terminate()
            master.wait(10)
    status, got = results["stream"]
    assert status == 200, (status, got[-200:])
    assert got.rstrip().endswith(b"data: [DONE]"), got[-200:]
    assert results["whole"][0] == 200, results["whole"]
    assert results["whole"][1]["usage"]["completion_tokens"] == 100
    assert during.status_code == 200, during.text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(done: Callable[[], bool], timeout: float = 10) -> None:
    """Until ``done()``; ``timeout`` only bounds a broken run."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.05)
