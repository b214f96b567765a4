"""Rolling restarts and a dead engine behind a real nginx and a real HAProxy, under modest load.

Three simulated engines with a shim each (two slots, a queue of four) behind the load balancer
running the shipped configuration; four closed-loop callers (half the fleet's slots): two use
the SDK (``llm_backoff.wrap`` with a 20 s deadline, whole answers), two plain openai (its own
two retries, streamed answers). Under that load:

1. replica 0's shim gets SIGTERM (it stops accepting, finishes what it holds, exits) and is
   started again on its port;
2. replica 1's engine is killed (SIGKILL: its streams are cut) and started again on its port.

Checked: no SDK call fails; no openai call fails before its answer began (a stream cut on the
killed engine is the only failure allowed); with HAProxy, a replica is taken out of rotation
when its /ready fails (shim gone, or its engine gone), gets no calls while out, and is taken
back when /ready answers; every replica serves calls again by the end. How long each step took
is printed (from this test's clock, the shims' access logs and HAProxy's log), never asserted.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

from llm_backoff_shim.lab.fleet import Fleet
from llm_backoff_shim.lab.fleet_configs import lb_binary

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(180)

ITL = 0.01
SIM_FLAGS = (
    "--ttft", "0.02", "--itl", str(ITL), "--itl-batch-factor", "0", "--prefill-time-per-token", "0",
    "--output-tokens", "1000", "--output-tokens-sigma", "0",
)  # fmt: skip
SHIM_FLAGS = ("--max-concurrency", "2", "--max-queue", "4", "--log-level", "info", "--log-format", "json")
CALL = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}  # ~0.3 s


def need(lb: str) -> None:
    if lb_binary(lb) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{lb} is not installed, and CI must run this test (scripts/test.sh installs it)")
        pytest.skip(f"{lb} is not installed (apt-get install {lb})")


def stamp(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["time"]).timestamp()


def arrival(record: dict[str, Any]) -> float:
    return stamp(record) - record["total_ms"] / 1000


class Load:
    """Closed-loop callers until :meth:`stop`; results kept per kind."""

    def __init__(self, fleet: Fleet) -> None:
        from llm_backoff import RetryPolicy, wrap

        self.url = f"{fleet.url}/v1"
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.ok = {"sdk": 0, "openai": 0}
        self.failed: list[tuple[str, float, bool, str]] = []  # kind, when, answer had begun, error
        self.sdk = wrap(openai.OpenAI(base_url=self.url, api_key="x"), RetryPolicy(deadline=20))
        self.plain = openai.OpenAI(base_url=self.url, api_key="x")
        self.threads = [
            threading.Thread(target=self._loop, args=(self._sdk_call, "sdk"), daemon=True),
            threading.Thread(target=self._loop, args=(self._sdk_call, "sdk"), daemon=True),
            threading.Thread(target=self._loop, args=(self._openai_stream, "openai"), daemon=True),
            threading.Thread(target=self._loop, args=(self._openai_stream, "openai"), daemon=True),
        ]

    def _sdk_call(self, began: list[bool]) -> None:
        self.sdk.chat.completions.create(**CALL)
        began.append(True)

    def _openai_stream(self, began: list[bool]) -> None:
        chunks = 0
        stream = self.plain.chat.completions.create(**CALL, stream=True)
        began.append(True)  # the answer's head has arrived: from here on a failure is a cut stream
        for _ in stream:
            chunks += 1
        assert chunks > 1

    def _loop(self, call: Callable[[list[bool]], None], kind: str) -> None:
        while not self.stopping.is_set():
            began: list[bool] = []
            try:
                call(began)
            except Exception as exc:  # every failure is recorded, and judged below
                with self.lock:
                    self.failed.append((kind, time.time(), bool(began), f"{type(exc).__name__}: {exc}"[:200]))
            else:
                with self.lock:
                    self.ok[kind] += 1
            time.sleep(0.02)

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(30)


class HAProxyStates:
    """When HAProxy's log first said each replica went DOWN / UP (polled every 20 ms)."""

    LINE = re.compile(r"^Server \S+/(replica\d+) is (DOWN|UP)(.*)$", re.MULTILINE)

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.seen: list[tuple[str, str, float]] = []
        self.reasons: list[str] = []  # HAProxy's own words, for a failure's message
        self._count = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(0.02):
            found = self.LINE.findall(self.fleet.lb_log())
            now = time.time()
            for server, state, reason in found[self._count :]:
                self.seen.append((server, state, now))
                self.reasons.append(f"{server} {state}{reason}")
            self._count = len(found)

    def first(self, server: str, state: str, after: float) -> float | None:
        return next((t for s, st, t in self.seen if s == server and st == state and t >= after), None)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)


def first_arrival_after(fleet: Fleet, i: int, moment: float, outcome: str = "completed") -> float | None:
    times = [arrival(r) for r in fleet.access_records(i) if r["outcome"] == outcome and arrival(r) >= moment]
    return min(times, default=None)


def wait_for(predicate: Callable[[], float | None], timeout: float = 15.0) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value is not None:
            return value
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("lb", ["nginx", "haproxy"])
def test_rolling_restart_and_dead_engine_lose_no_call(lb: str) -> None:
    need(lb)
    with Fleet(3, lb, sim_flags=SIM_FLAGS, shim_flags=SHIM_FLAGS) as fleet:
        states = HAProxyStates(fleet) if lb == "haproxy" else None
        load = Load(fleet).start()
        timings: dict[str, float | None] = {}
        try:
            time.sleep(1.5)
            # 1. Rolling restart of replica 0's shim.
            t_term = time.time()
            timings["shim SIGTERM -> exited (drained)"] = fleet.stop_shim(0)
            time.sleep(1.5)
            t_start = time.time()
            started = fleet.start_shim(0)
            timings["shim start -> /health answers"] = started
            shim_up = t_start + started
            back = wait_for(lambda: first_arrival_after(fleet, 0, shim_up))
            timings["shim up -> first call it serves"] = None if back is None else back - shim_up
            time.sleep(1.0)

            # 2. Replica 1's engine crashes and comes back.
            t_kill = time.time()
            fleet.kill_engine(1)
            time.sleep(2.0)
            t_engine = time.time()
            started = fleet.start_engine(1)
            timings["engine start -> /health answers"] = started
            engine_up = t_engine + started
            back = wait_for(lambda: first_arrival_after(fleet, 1, engine_up))
            timings["engine up -> first call its shim serves"] = None if back is None else back - engine_up
            time.sleep(1.0)
        finally:
            load.stop()
            if states is not None:
                states.stop()
        time.sleep(0.3)

        if states is not None:
            down0 = states.first("replica1", "DOWN", t_term)
            up0 = states.first("replica1", "UP", t_start)
            down1 = states.first("replica2", "DOWN", t_kill)
            up1 = states.first("replica2", "UP", t_engine)
            print(f"\nHAProxy states seen: {[(s, st, round(t - t_term, 2)) for s, st, t in states.seen]}")
            assert down0 is not None, states.reasons
            assert up0 is not None, states.reasons
            assert down1 is not None, states.reasons
            assert up1 is not None, states.reasons
            timings["HAProxy: shim SIGTERM -> replica out"] = down0 - t_term
            timings["HAProxy: shim up -> replica back"] = up0 - (
                t_start + (timings["shim start -> /health answers"] or 0)
            )
            timings["HAProxy: engine SIGKILL -> replica out"] = down1 - t_kill
            timings["HAProxy: engine up -> replica back"] = up1 - engine_up
            # While out of rotation, the replica whose engine was dead got no call (50 ms of
            # slack for a check's result reaching the log poll).
            during = [r for r in fleet.access_records(1) if down1 + 0.05 < arrival(r) < up1 - 0.05]
            assert during == [], during[:3]
        else:
            wasted = re.findall(r"upstatus=(?:502|503|504)[^\n]*", fleet.lb_log())
            print(f"\nnginx: calls that paid a failed first try on a replica that was down: {len(wasted)}")

    print(f"{lb}: calls completed {load.ok}; failures {len(load.failed)}")
    for kind, when, began, error in load.failed:
        print(f"  {kind} at +{when - t_term:.2f} s, answer begun: {began}: {error}")
    for name, seconds in timings.items():
        print(f"  {name}: {'-' if seconds is None else f'{seconds:.2f} s'}")
    assert load.ok["sdk"] > 0
    assert load.ok["openai"] > 0
    assert [f for f in load.failed if f[0] == "sdk"] == []
    # A plain openai call fails only if its stream was cut on the killed engine.
    assert [f for f in load.failed if not f[2]] == []
    assert all(t_kill <= when for _, when, _, _ in load.failed)
    assert timings["shim up -> first call it serves"] is not None
    assert timings["engine up -> first call its shim serves"] is not None
