"""Tenant quotas across a fleet: three shims, one real Redis, counted calls against the allowance.

Each tenant's bucket (``serve/policy/quota.py``) holds one minute's worth and refills at the
per-minute rate, on the Redis clock. Callers spread their calls round robin over the three shims,
as a load balancer would, as fast as the shims answer, so the bucket, full until its first
charge, never fills up again while they run (a call takes milliseconds, the refill one call's
worth in 0.2 s). From its first charge at ``F`` to its last update at ``T`` (both stamped by
Redis, ``T`` stored in the bucket with its level ``L``) a tenant was admitted exactly
``Q - L + Q / 60 * (T - F)`` requests (LLM tokens for a token quota, once every answer's usage
corrected its charge). The test knows ``F`` only as lying between the first call's start and the
first answer, so it checks that the bucket's own accounting puts ``F`` there; and, against the
calls alone, that no more was admitted than a full bucket and its refill from the first call's
start allow, and that every refusal came with less than a call's worth left: at least
``Q - 1 + Q / 60 * (R - E)`` were admitted before a refusal that started at ``R``, where ``E`` is
the end of the first call. Every time here is when something was seen to happen; how fast the
machine runs moves none of these bounds past the truth.

Then Redis goes away mid-run, twice: a graceful stop (SIGTERM: it saves its data and loads it
again on start, as a default ``redis.conf`` does) and a crash of a Redis without persistence
(SIGKILL, started again without data). While it is away a limited tenant's calls get the documented answer
(503 ``upstream_unavailable``, ``Retry-After`` = ``--retry-after-min``) at once and an unlimited
tenant is served as usual; once it answers again, quotas are enforced from the first call: after
the graceful stop with the bucket it had (refilled for the time it was away), after the crash
with a full bucket (one more minute's burst).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from llm_backoff.redis_bucket import bucket_key
from llm_backoff_shim.decide.tenants import key_hash
from llm_backoff_shim.lab import procs
from llm_backoff_shim.serve.policy.quota import REDIS_TIMEOUT, TenantQuotas

redis = pytest.importorskip("redis")

RPM = 300  # requests per minute: a burst of 300, then 5 per second
TPM = 18_000  # LLM tokens per minute: a burst of 18 000, then 300 per second (about 5 calls)
PROMPT = "count " * 40  # about 60 tokens a call: the prompt, since the engine's work is one token
RETRY_AFTER_MIN = 1.0
SIM_FLAGS = (
    "--max-num-seqs", "64", "--ttft", "0", "--itl", "0", "--prefill-time-per-token", "0",
    "--output-tokens", "1", "--output-tokens-sigma", "0",
)  # fmt: skip
BODY = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": 1,
    "ignore_eos": True,
}
#: Concurrent callers per tenant; the unlimited tenant needs only to show it is served.
CALLERS = {"rpm": 6, "tpm": 6, "free": 1}
#: Float rounding of a Unix time (about 2e-7 s near 1.8e9 s) in the bucket's arithmetic.
ROUNDING = 1e-5

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis]


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed, and CI must run this test")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return found


class RedisServer:
    """Our own redis-server on a fixed loopback port, stopped and started again on that port."""

    def __init__(self, directory: Path) -> None:
        self.binary = redis_binary()
        self.dir = directory
        self.port = procs.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None
        self.client = redis.Redis.from_url(self.url, socket_timeout=2)
        self.spawned = 0.0  # time.time() just before the last start: Redis stamps nothing earlier

    def start(self, *, empty: bool = False) -> float:
        """Start it (``empty``: without the data it saved, as a Redis without persistence) and wait
        until it answers PING; returns when it did (time.time())."""
        if empty:
            (self.dir / "dump.rdb").unlink(missing_ok=True)
        self.spawned = time.time()
        # Snapshot on a graceful stop (any save point turns that on), none while the test runs.
        self._proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "3600 1", "--appendonly", "no", "--logfile", str(self.dir / "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client.ping():
                    return time.time()
            except redis.RedisError:
                time.sleep(0.01)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self, *, crash: bool = False) -> float:
        """SIGTERM (saves its data) or SIGKILL (loses it); returns once it is gone."""
        assert self._proc is not None
        if crash:
            self._proc.kill()
            self._proc.wait(10)
        else:
            procs.terminate(self._proc, 10)
        self._proc = None
        return time.time()

    def pause(self) -> float:
        """SIGSTOP: it keeps its connections but answers nothing (a hung host, a partition)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)
        return time.time()

    def resume(self) -> float:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)
        return time.time()

    def time(self) -> float:
        seconds, micros = self.client.time()
        return float(seconds) + micros / 1e6

    def bucket(self, api_key: str, name: str) -> tuple[float, float]:
        """A tenant's bucket as the shims' script left it: (last update on the Redis clock, level)."""
        base = "llm-backoff-shim:tenant:" + key_hash(key_hash(api_key))  # TenantQuotas._store
        stamp, level = self.client.hmget(bucket_key(base, name), ["t", "v"])
        assert stamp is not None, f"no {name} bucket in Redis for this tenant"
        assert level is not None
        return float(stamp), float(level)

    def close(self) -> None:
        if self._proc is not None:
            procs.terminate(self._proc, 5)
        self.client.close()


@dataclass
class Fleet:
    redis: RedisServer
    shims: list[procs.ChildServer]
    sims: list[procs.ChildServer]
    keys: dict[str, str]  # tenant name -> API key


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="llm-backoff-redis-") as tmp:
        directory = Path(tmp)
        server = RedisServer(directory)
        keys = {name: f"sk-{name}-{secrets.token_hex(6)}" for name in ("rpm", "tpm", "free")}
        tenants = directory / "tenants.json"
        tenants.write_text(
            json.dumps(
                {
                    "tenants": [
                        {"name": "rpm", "key": keys["rpm"], "requests_per_minute": RPM},
                        {"name": "tpm", "key": keys["tpm"], "tokens_per_minute": TPM},
                        {"name": "free", "key": keys["free"]},
                    ]
                }
            )
        )
        shim_flags = (
            "--redis-url", server.url, "--tenants-file", str(tenants), "--max-concurrency", "64",
            "--max-queue", "64", "--retry-after-min", str(RETRY_AFTER_MIN),
        )  # fmt: skip
        sims = [procs.sim_server(SIM_FLAGS) for _ in range(3)]
        shims = [procs.shim_server(sim, shim_flags) for sim in sims]
        try:
            server.start()
            for sim in sims:
                sim.launch()
            for sim, shim in zip(sims, shims, strict=True):
                sim.start()
                shim.launch()
            for shim in shims:
                shim.start()
            yield Fleet(server, shims, sims, keys)
        finally:
            for child in (*shims, *sims):
                child.close()
            server.close()


@dataclass(frozen=True)
class Call:
    tenant: str
    shim: int
    start: float
    end: float
    status: int
    code: str | None
    retry_after: str | None
    tokens: int  # usage.total_tokens of an answered call


@dataclass
class Callers:
    """``CALLERS[tenant]`` callers per tenant, each sending its next call when the last is answered, to
    the shims in turn (one counter per tenant, shared by its callers: round robin)."""

    fleet: Fleet
    tenants: Sequence[str]
    calls: list[Call] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _caller(self, client: httpx.AsyncClient, tenant: str, turn: list[int]) -> None:
        urls = [s.url + "/v1/chat/completions" for s in self.fleet.shims]
        headers = {"authorization": f"Bearer {self.fleet.keys[tenant]}"}
        while not self._stop.is_set():
            shim = turn[0] % len(urls)
            turn[0] += 1
            start = time.time()
            response = await client.post(urls[shim], json=BODY, headers=headers)
            data: dict[str, Any] = response.json()
            code = data["error"].get("code") if "error" in data else None
            tokens = data["usage"]["total_tokens"] if response.status_code == 200 else 0
            self.calls.append(
                Call(tenant, shim, start, time.time(), response.status_code, code,
                     response.headers.get("retry-after"), tokens)
            )  # fmt: skip

    async def run(self, steps: Sequence[tuple[float, Any]]) -> list[float]:
        """Call until the steps are done: each is (seconds to wait, function to run then); returns
        what each function returned."""
        # A kept-alive connection idles while its caller calls the other shims; the pool drops
        # it well before the shims' own idle timeout (uvicorn's 5 s, httpx's default expiry
        # too), so a call never goes out on a connection the shim is closing at that moment.
        limits = httpx.Limits(max_connections=sum(CALLERS.values()) * 3, keepalive_expiry=2.0)
        results = []
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            turns = {t: [0] for t in self.tenants}
            tasks = [
                asyncio.create_task(self._caller(client, t, turns[t]))
                for t in self.tenants
                for _ in range(CALLERS[t])
            ]
            try:
                for wait, action in steps:
                    await asyncio.sleep(wait)
                    results.append(await asyncio.to_thread(action))
            finally:
                self._stop.set()
                await asyncio.gather(*tasks)
        return results


def until(done: Callable[[], bool], timeout: float = 30.0) -> Callable[[], float]:
    """A step that waits (in a thread, while the callers call) until ``done()``; returns when."""

    def wait() -> float:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "the callers did not get there in time"
            time.sleep(0.02)
        return time.time()

    return wait


def refused(calls: Sequence[Call], tenant: str, after: float = 0.0) -> bool:
    return any(c.tenant == tenant and c.status == 429 and c.start > after for c in list(calls))


def allowance(per_minute: float, seconds: float) -> float:
    """The most a bucket of one minute's worth, full at the start, lets through in ``seconds``."""
    return per_minute + per_minute / 60 * seconds


def shims_done(fleet: Fleet, calls: int) -> None:
    """Until the shims have finished ``calls`` requests in all: a shim counts a request's outcome
    once its quota correction was sent (proxy.py), so every bucket then holds all of them."""
    deadline = time.monotonic() + 30
    while True:
        finished = 0
        for shim in fleet.shims:
            with httpx.Client(timeout=5) as client:
                text = client.get(shim.url + "/metrics").text
            for line in text.splitlines():
                if line.startswith("llm_backoff_shim_requests_total{") and 'outcome="admitted"' not in line:
                    finished += int(float(line.rsplit(" ", 1)[1]))
        if finished == calls:
            return
        assert finished < calls, (finished, calls)
        assert time.monotonic() < deadline, f"the shims finished {finished} of {calls} requests"
        time.sleep(0.02)


def check_accounting(
    what: str, admitted: float, per_minute: float, bucket: tuple[float, float], first: Sequence[Call]
) -> None:
    """``admitted`` (requests or tokens) is what a bucket of ``per_minute`` that ended at
    ``bucket`` took since its first charge, and that charge came during the first of ``first``."""
    stamp, level = bucket
    charged_at = stamp - (admitted - per_minute + level) / (per_minute / 60)
    earliest, latest = min(c.start for c in first), min(c.end for c in first)
    assert earliest - ROUNDING <= charged_at <= latest + ROUNDING, (
        f"{what}: {admitted:g} admitted put the bucket's first charge "
        f"{charged_at - earliest:+.3f} s from the first call's start ({latest - earliest:.3f} s to its end)"
    )


def refused_without_room(what: str, admitted: int, refusal: Call, first_end: float) -> None:
    """The rpm bucket refused ``refusal`` with less than one request left, in a bucket first
    charged before ``first_end``: more than ``RPM - 1`` and the refill since then had been
    admitted when its script ran (after the call started); ``admitted`` counts at least those."""
    floor = RPM - 1 + RPM / 60 * (refusal.start - first_end)
    assert admitted > floor - ROUNDING, (
        f"{what}: {admitted} admitted, but a refusal says more than {floor:.2f}"
    )


def test_three_shims_enforce_one_quota_and_ride_out_redis_going_away(fleet: Fleet) -> None:
    server = fleet.redis
    tenants = ("rpm", "tpm", "free")

    # 1. Redis up: every call from t0 to t1, spread over the three shims, counted.
    enforcing = Callers(fleet, tenants)
    t0 = server.time()
    # Until both limited tenants used up their burst, then a while on the refill alone.
    both_refused = until(lambda: refused(enforcing.calls, "rpm") and refused(enforcing.calls, "tpm"))
    asyncio.run(enforcing.run([(0.0, both_refused), (2.0, lambda: None)]))
    t1 = server.time()
    calls = enforcing.calls
    shims_done(fleet, len(calls))
    rpm = [c for c in calls if c.tenant == "rpm"]
    admitted = sum(1 for c in rpm if c.status == 200)
    allowed = allowance(RPM, t1 - t0)
    assert {c.status for c in rpm} == {200, 429}
    assert {c.code for c in rpm if c.status == 429} == {"tenant_rate_limited"}
    assert {c.shim for c in rpm if c.status == 200} == {0, 1, 2}
    # One bucket for the three shims: no more than it holds and refills from before the first
    # call to after the last; exactly what its own accounting says; a refusal only when empty.
    assert admitted <= allowed, (admitted, allowed)
    check_accounting("rpm", admitted, RPM, server.bucket(fleet.keys["rpm"], "requests"), rpm)
    first_end = min(c.end for c in rpm)
    last_refusal = max((c for c in rpm if c.status == 429), key=lambda c: c.start)
    refused_without_room("rpm", admitted, last_refusal, first_end)
    tpm = [c for c in calls if c.tenant == "tpm"]
    used = sum(c.tokens for c in tpm)
    allowed_tokens = allowance(TPM, t1 - t0)
    assert {c.status for c in tpm} == {200, 429}
    # A call is charged its estimate, then its usage once answered: the bucket took the usage.
    check_accounting("tpm", used, TPM, server.bucket(fleet.keys["tpm"], "tokens"), tpm)
    assert {c.status for c in calls if c.tenant == "free"} == {200}
    print(
        f"Redis up {t1 - t0:.2f} s: rpm tenant {admitted} calls admitted of {allowed:.1f} allowed "
        f"({len(rpm)} sent); tpm tenant {used} tokens of {allowed_tokens:.0f} allowed "
        f"({sum(1 for c in tpm if c.status == 200)} of {len(tpm)} calls admitted)"
    )

    # 2. Redis away twice: a graceful stop (data saved and loaded again), then a crash of a Redis
    # without persistence (data lost).
    riding = Callers(fleet, tenants)
    crash_times: list[float] = []

    def crash() -> float:
        crash_times.append(server.stop(crash=True))
        return crash_times[-1]

    def crashed_at() -> float:
        return crash_times[0]

    stopped, restarted, crashed, back, _, _, paused, resumed, _ = asyncio.run(
        riding.run(
            [
                (0.5, server.stop),
                (1.0, server.start),
                (1.5, crash),
                (1.0, lambda: server.start(empty=True)),
                (0.0, until(lambda: refused(riding.calls, "rpm", after=crashed_at()))),  # a new burst used up
                (0.5, server.time),
                (0.0, server.pause),  # hung: connections stay open, nothing answers
                (1.5, server.resume),
                (1.0, server.time),
            ]
        )
    )
    calls = riding.calls
    for down, up in ((stopped, restarted), (crashed, back)):
        away = [c for c in calls if c.tenant != "free" and down < c.start and c.end < up - 0.05]
        assert away
        assert {(c.status, c.code, c.retry_after) for c in away} == {
            (503, "upstream_unavailable", str(math.ceil(RETRY_AFTER_MIN)))
        }
        slowest = max(c.end - c.start for c in away)
        assert slowest < 2.0, slowest  # refused at once (a hang would show here)
        # The first calls after Redis answers again are the quota's to decide.
        later = sorted((c for c in calls if c.tenant == "rpm" and c.start >= up), key=lambda c: c.start)
        assert later[0].status in (200, 429), later[:3]
        print(
            f"Redis away {up - down:.2f} s: {len(away)} limited calls, all 503 in at most "
            f"{slowest * 1000:.0f} ms; back: the first rpm call after it got {later[0].status} "
            f"{(later[0].end - up) * 1000:.0f} ms after Redis answered PING"
        )
    assert {c.status for c in calls if c.tenant == "free"} == {200}

    # A hung Redis: refused after the shim's Redis timeout (REDIS_TIMEOUT), not redis-py's default
    # (5 s, or no limit before redis-py 8); served again once it answers.
    hung = [c for c in calls if c.tenant != "free" and paused < c.start and c.end < resumed]
    assert hung
    assert {(c.status, c.code) for c in hung} == {(503, "upstream_unavailable")}
    slowest = max(c.end - c.start for c in hung)
    assert slowest < 4 * REDIS_TIMEOUT, slowest
    after_hang = sorted((c for c in calls if c.tenant == "rpm" and c.start > resumed), key=lambda c: c.start)
    assert {c.status for c in after_hang} <= {200, 429}
    assert {c.status for c in calls if c.tenant == "free"} == {200}
    print(
        f"Redis hung {resumed - paused:.2f} s: {len(hung)} limited calls, all 503, the slowest in "
        f"{slowest * 1000:.0f} ms; after SIGCONT {len(after_hang)} rpm calls, none 503"
    )

    # 3. Enforced across the stops. Graceful: the bucket survives, refilled for the time Redis
    # was away, so from its first charge to the crash it is one bucket. Crash: a new full bucket.
    # A call whose charge went through but whose answer Redis' going away cut (a 503) was
    # charged without being served: around the graceful stop, a call that started before it;
    # around the hang, one that ended after Redis was back from the crash.
    shims_done(fleet, len(enforcing.calls) + len(calls))
    rpm = [c for c in (*enforcing.calls, *calls) if c.tenant == "rpm"]
    before = sum(1 for c in rpm if c.status == 200 and c.end < crashed)
    allowed = allowance(RPM, crashed - t0)
    assert before <= allowed, (before, allowed)
    last_refusal = max((c for c in rpm if c.status == 429 and c.end < crashed), key=lambda c: c.start)
    charged = sum(
        1
        for c in rpm
        if (c.status == 200 and c.start < last_refusal.end) or (c.status == 503 and c.start < stopped)
    )
    refused_without_room("rpm before the crash", charged, last_refusal, first_end)

    after_crash = [c for c in rpm if c.end > crashed]
    after = sum(1 for c in after_crash if c.status == 200 and c.start >= crashed)
    # The new bucket's first charge came after Redis was started again, and by the end of the
    # first call sent once it answered; its last update is the bucket's own.
    stamp, level = server.bucket(fleet.keys["rpm"], "requests")
    first_end_after = min(c.end for c in after_crash if c.start >= back and c.status in (200, 429))
    most = RPM - level + RPM / 60 * (stamp - server.spawned)
    least = RPM - level + RPM / 60 * (stamp - first_end_after)
    # Between the calls served after the crash and those plus every call that could have been
    # charged unserved, lies what the bucket took.
    lost = sum(1 for c in after_crash if c.status == 503 and c.end > back)
    served_at_most = sum(1 for c in after_crash if c.status == 200) + lost
    assert after <= most + ROUNDING, (after, most)
    assert least - ROUNDING <= served_at_most, (served_at_most, least)
    last_refusal = max((c for c in after_crash if c.status == 429), key=lambda c: c.start)
    charged = lost + sum(1 for c in after_crash if c.status == 200 and c.start < last_refusal.end)
    refused_without_room("rpm after the crash", charged, last_refusal, first_end_after)
    print(
        f"t0 to the crash: {before} rpm calls admitted of {allowed:.1f} allowed; "
        f"after it: {after} (the new bucket took {least:.1f} to {most:.1f})"
    )


def test_the_quota_store_client_gives_up_after_the_shim_timeout_unless_the_url_says_otherwise() -> None:
    def timeouts(url: str) -> tuple[object, object]:
        quotas = TenantQuotas(clock=time.monotonic, redis_url=url)
        try:
            kwargs = quotas._redis_client.connection_pool.connection_kwargs
            return kwargs["socket_timeout"], kwargs["socket_connect_timeout"]
        finally:
            quotas.close()

    assert timeouts("redis://127.0.0.1:6399/0") == (REDIS_TIMEOUT, REDIS_TIMEOUT)
    assert timeouts("redis://127.0.0.1:6399/0?socket_timeout=2&socket_connect_timeout=3") == (2.0, 3.0)
