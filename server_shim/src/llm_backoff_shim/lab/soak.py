"""A soak with faults: many requests through the shim to a faulty simulator, then a leak audit.

Used by ``server_shim/tests/lab/test_soak.py`` (CI-sized) and ``bench/soak.py`` (longer,
opt-in). Simulator and shim run in this process, each under uvicorn in its own thread
and event loop (:class:`~llm_backoff_shim.serve.serving.ServerThread`), so the audit can
look inside them: the admission state, the asyncio tasks of both loops, this
process's file descriptors and resident memory.

The load mixes, per request (seeded): plain httpx calls with and without
``x-request-timeout-ms``, streams read to the end, clients that leave while queued
or mid-stream, and ``llm_backoff``-wrapped openai clients with deadlines (plain and
streaming). The simulator injects 500s, connection resets, slow first bytes and cut
streams. Every call runs under a watchdog of its deadline plus a grace: one that
trips it is counted as a hang.

Audit after the load (:func:`settle`, :func:`metric_values`; its findings are a
:class:`SoakReport`), once clients are closed and idle
connections have expired: shim gauges (controller, ``/metrics``) at zero, no future left
waiting, asyncio tasks and file descriptors back to their post-warm-up baseline, and
resident memory growth measured against the post-warm-up figure (the caller decides the
bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from pydantic import AnyHttpUrl

import llm_backoff
from llm_backoff_shim.serve.app import ShimRuntime, create_app, shim_state
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.tuning import Tuning
from llm_backoff_shim.serve.serving import ServerThread, shim_server
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

# -- the configuration and the report ------------------------------------------------------
# What a soak is asked to do (:class:`SoakConfig`) and what it found (:class:`SoakReport`).
#
# The report's :meth:`~SoakReport.leaks` is the audit's verdict: everything that did not come
# back after the load; :meth:`~SoakReport.summary` the figures as JSON-ready values.

KINDS: dict[str, float] = {
    "plain": 0.30,
    "plain_budget": 0.10,
    "stream": 0.15,
    "leave_queued": 0.10,
    "leave_streaming": 0.10,
    "sdk": 0.15,
    "sdk_stream": 0.10,
}


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 2000
    seconds: float | None = None
    concurrency: int = 48
    seed: int = 7
    sdk_deadline: float = 3.0
    grace: float = 2.0
    raw_limit: float = 15.0
    warmup: int = 150
    error_rate: float = 0.04
    reset_rate: float = 0.03
    slow_first_byte_rate: float = 0.03
    slow_first_byte_delay: float = 0.3
    stream_cut_rate: float = 0.10
    output_tokens: int = 12
    long_output_tokens: int = 200
    max_concurrency: int = 8
    max_queue: int = 16
    max_queue_wait: float = 1.5
    settle_timeout: float = 20.0
    #: (kind, weight) pairs; default :data:`KINDS`.
    kinds: tuple[tuple[str, float], ...] = tuple(KINDS.items())
    #: False: clients call the simulator directly (the SDK alone against the faults).
    through_shim: bool = True


@dataclass
class Snapshot:
    tasks_shim: int
    tasks_sim: int
    fds: int
    rss_mib: float
    #: open client connections of the shim's and the simulator's HTTP servers
    connections_shim: int = 0
    connections_sim: int = 0


@dataclass
class SoakReport:
    config: SoakConfig
    requests: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    faults: dict[str, int] = field(default_factory=dict)
    hangs: int = 0
    late: int = 0
    untyped: list[str] = field(default_factory=list)
    duplicate_streams: int = 0
    retries_after_stream_start: int = 0
    shim_errors_without_retry_after: int = 0
    seconds: float = 0.0
    baseline: Snapshot | None = None
    after: Snapshot | None = None
    gauges_after: dict[str, float] = field(default_factory=dict)
    waiting_futures_after: int = -1
    bad_requests: dict[str, float] = field(default_factory=dict)
    shim_counts: dict[str, float] = field(default_factory=dict)
    #: (requests sent, resident MiB) every tenth of the run: flat means no growth per request.
    rss_samples: list[tuple[int, float]] = field(default_factory=list)

    @property
    def disconnects(self) -> int:
        return self.outcomes["client_left"] + self.outcomes["client_left_stream"]

    def leaks(self) -> list[str]:
        """Everything the audit found wrong; empty when nothing leaked."""
        found: list[str] = []
        if any(self.gauges_after.values()):
            found.append(f"gauges not at zero: {self.gauges_after}")
        if self.waiting_futures_after != 0:
            found.append(f"{self.waiting_futures_after} admission futures still waiting")
        if self.baseline is not None and self.after is not None:
            b, a = self.baseline, self.after
            if a.tasks_shim > b.tasks_shim:
                found.append(f"shim tasks {b.tasks_shim} -> {a.tasks_shim}")
            if a.tasks_sim > b.tasks_sim:
                found.append(f"sim tasks {b.tasks_sim} -> {a.tasks_sim}")
            if a.fds > b.fds:
                found.append(f"file descriptors {b.fds} -> {a.fds}")
            if a.connections_shim or a.connections_sim:
                found.append(f"open connections: shim {a.connections_shim}, sim {a.connections_sim}")
        return found

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "seconds": round(self.seconds, 1),
            "by_kind": dict(sorted(self.by_kind.items())),
            "outcomes": dict(sorted(self.outcomes.items())),
            "faults_injected": self.faults,
            "disconnects": self.disconnects,
            "hangs": self.hangs,
            "late": self.late,
            "untyped_errors": len(self.untyped),
            "duplicate_streams": self.duplicate_streams,
            "retries_after_stream_start": self.retries_after_stream_start,
            "shim_rejections_without_retry_after": self.shim_errors_without_retry_after,
            "shim_counts": self.shim_counts,
            "bad_requests": self.bad_requests,
            "gauges_after": self.gauges_after,
            "baseline": None if self.baseline is None else vars(self.baseline),
            "after": None if self.after is None else vars(self.after),
            "rss_samples": self.rss_samples,
            "leaks": self.leaks(),
        }


# -- the audit -----------------------------------------------------------------------------
# The soak's leak audit: looking inside the shim and the simulator once the load is over.
#
# Both servers run in this process, each in its own thread and event loop, so the audit
# counts their asyncio tasks and open connections on their own loops (:func:`on_loop`),
# and this process's file descriptors and resident memory; the shim's counters come from
# its ``/metrics``.


def rss_mib() -> float:
    """This process's resident memory in MiB (Linux ``/proc``); NaN where it is not reported."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def fd_count() -> int:
    """This process's open file descriptors (Linux ``/proc``)."""
    return len(os.listdir("/proc/self/fd"))


def on_loop(server: ServerThread, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on ``server``'s own event loop (its thread), waited for up to 10 s."""
    loop = server.loop
    assert loop is not None

    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(10)


def task_count(server: ServerThread) -> int:
    """The asyncio tasks alive on ``server``'s event loop."""
    # Minus one: the task that does the counting.
    return int(on_loop(server, lambda: len(asyncio.all_tasks()))) - 1


def settle(
    shim: ServerThread, sim: ServerThread, runtime: ShimRuntime, baseline: Snapshot | None, timeout: float
) -> Snapshot:
    """Wait (bounded) until the shim is idle and idle connections have closed; then measure."""
    end = time.monotonic() + timeout
    while True:
        gc.collect()
        idle = on_loop(shim, lambda: runtime.controller.in_flight() + runtime.controller.queued()) == 0
        snap = Snapshot(
            task_count(shim),
            task_count(sim),
            fd_count(),
            rss_mib(),
            on_loop(shim, lambda: len(shim.server.server_state.connections)),
            on_loop(sim, lambda: len(sim.server.server_state.connections)),
        )
        settled = idle and (
            baseline is None
            or (
                snap.tasks_shim <= baseline.tasks_shim
                and snap.tasks_sim <= baseline.tasks_sim
                and snap.fds <= baseline.fds
                and snap.connections_shim == 0
                and snap.connections_sim == 0
            )
        )
        if settled or time.monotonic() > end:
            return snap
        time.sleep(0.1)


def metric_values(url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics as {"name,label=value,...": value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def outcome_counts(values: dict[str, float]) -> dict[str, float]:
    """``llm_backoff_shim_requests_total`` as {"outcome" or "outcome:code": count}."""
    counts: Counter[str] = Counter()
    for key, value in values.items():
        if key.startswith("llm_backoff_shim_requests_total,"):
            labels = dict(part.split("=", 1) for part in key.split(",")[1:])
            name = labels["outcome"] + (f":{labels['code']}" if labels.get("code") else "")
            counts[name] += int(value)
    return dict(sorted(counts.items()))


# -- the run -------------------------------------------------------------------------------

_call_id: contextvars.ContextVar[int | None] = contextvars.ContextVar("soak_call_id", default=None)


def _tokens(text: str) -> list[str]:
    return text.split()


def _is_prefix_sequence(tokens: list[str]) -> bool:
    """The simulator answers token0 token1 ...: in order, each once (a prefix when cut)."""
    return tokens == [f"token{i}" for i in range(len(tokens))]


class _Run:
    def __init__(self, config: SoakConfig, shim_url: str, report: SoakReport) -> None:
        self.config = config
        self.url = shim_url
        self.report = report
        self.started_streams: set[int] = set()

    def _finished(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.report.untyped.append(f"driver: {task.exception()!r}")

    def _hook(self, event: llm_backoff.RetryEvent) -> None:
        if _call_id.get() in self.started_streams:
            self.report.retries_after_stream_start += 1

    async def run(self, count: int, *, progress: Callable[[str], None] | None, measured: bool) -> None:
        config = self.config
        rng = random.Random(config.seed + (1 if measured else 0))
        limits = httpx.Limits(
            max_connections=config.concurrency * 2, max_keepalive_connections=config.concurrency
        )
        async with httpx.AsyncClient(timeout=httpx.Timeout(config.raw_limit), limits=limits) as http:
            base = openai.AsyncOpenAI(
                base_url=self.url + "/v1", api_key="sk-soak", max_retries=0, timeout=config.raw_limit
            )
            policy = llm_backoff.RetryPolicy(deadline=config.sdk_deadline, base_delay=0.05, max_delay=0.5)
            sdk = llm_backoff.wrap(base, policy, on_retry=self._hook)
            try:
                gate = asyncio.Semaphore(config.concurrency)
                deadline = None if config.seconds is None else time.monotonic() + config.seconds
                names, weights = [k for k, _ in config.kinds], [w for _, w in config.kinds]
                # Finished tasks are dropped at once: the driver must not grow with the run, or the
                # memory audit would measure the client instead of the servers.
                pending: set[asyncio.Task[None]] = set()
                step = max(1, count // 10)
                for i in range(count):
                    if deadline is not None and time.monotonic() > deadline:
                        break
                    kind = rng.choices(names, weights)[0]
                    await gate.acquire()
                    # Call ids are unique across runs (warm-up and measured) for the stream bookkeeping.
                    call = i if measured else -1 - i
                    task = asyncio.create_task(self._one(call, kind, rng.random(), http, sdk, measured))
                    task.add_done_callback(self._finished)
                    task.add_done_callback(lambda _t: gate.release())
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    if measured and (i + 1) % step == 0:
                        rss = rss_mib()
                        self.report.rss_samples.append((i + 1, round(rss, 1)))
                        if progress is not None:
                            done = sum(self.report.outcomes.values())
                            progress(
                                f"soak: {i + 1}/{count} sent, {done} finished, {self.report.hangs} hangs, "
                                f"rss {rss:.1f} MiB"
                            )
                await asyncio.gather(*pending)
            finally:
                await sdk.close()
                await base.close()

    async def _one(
        self, i: int, kind: str, draw: float, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI, measured: bool
    ) -> None:
        _call_id.set(i)
        config = self.config
        limit = (
            config.sdk_deadline + config.grace if kind.startswith("sdk") else config.raw_limit + config.grace
        )
        started = time.monotonic()
        try:
            outcome = await asyncio.wait_for(self._call(i, kind, draw, http, sdk), limit)
        except TimeoutError:
            outcome = "hang"
        if not measured:
            return
        report = self.report
        report.requests += 1
        report.by_kind[kind] += 1
        report.outcomes[outcome] += 1
        if outcome == "hang":
            report.hangs += 1
        elif kind.startswith("sdk") and time.monotonic() - started > config.sdk_deadline + config.grace:
            report.late += 1

    async def _call(
        self, i: int, kind: str, draw: float, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI
    ) -> str:
        body: dict[str, Any] = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": f"soak request {i}"}],
        }
        if kind != "leave_streaming":
            # Short answers; a client that leaves mid-stream gets the long natural one, so that
            # it really leaves while the engine is still generating.
            body["max_tokens"] = self.config.output_tokens
        headers: dict[str, str] = {}
        if kind == "plain_budget":
            headers["x-request-timeout-ms"] = str(int(200 + draw * 3000))
        try:
            if kind in ("plain", "plain_budget"):
                response = await http.post(self.url + "/v1/chat/completions", json=body, headers=headers)
                return self._judge(response, response.content)
            if kind == "stream":
                return await self._stream(http, body, leave_after=None)
            if kind == "leave_streaming":
                return await self._stream(http, body, leave_after=1 + int(draw * 3))
            if kind == "leave_queued":
                task = asyncio.ensure_future(http.post(self.url + "/v1/chat/completions", json=body))
                await asyncio.sleep(draw * 0.2)
                if task.done():
                    response = task.result()
                    return self._judge(response, response.content)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task
                return "client_left"
            if kind == "sdk":
                completion = await sdk.chat.completions.create(
                    model="sim-model", messages=body["messages"], max_tokens=self.config.output_tokens
                )
                text = completion.choices[0].message.content or ""
                if not _is_prefix_sequence(_tokens(text)):
                    self.report.duplicate_streams += 1
                return "ok"
            return await self._sdk_stream(i, sdk, body)
        except httpx.HTTPError as exc:
            return f"error:{type(exc).__name__}"
        except openai.APIStatusError as exc:
            return f"sdk_status:{exc.status_code}"
        except openai.APIError as exc:
            return f"sdk_error:{type(exc).__name__}"
        except llm_backoff.RateLimitTimeout:
            return "sdk_error:RateLimitTimeout"
        except Exception as exc:  # anything else is an untyped failure: the soak reports it
            self.report.untyped.append(f"{kind}: {type(exc).__name__}: {exc}")
            return "untyped"

    def _judge(self, response: httpx.Response, content: bytes) -> str:
        if response.status_code == 200:
            return "ok"
        try:
            error = json.loads(content)["error"]
            assert isinstance(error["message"], str)
        except Exception:
            self.report.untyped.append(f"status {response.status_code} without an OpenAI error body")
            return "untyped"
        if response.status_code in (429, 503) and "retry-after" not in response.headers:
            self.report.shim_errors_without_retry_after += 1
        return f"status:{response.status_code}"

    async def _stream(self, http: httpx.AsyncClient, body: dict[str, Any], leave_after: int | None) -> str:
        request = {**body, "stream": True}
        async with http.stream("POST", self.url + "/v1/chat/completions", json=request) as response:
            if response.status_code != 200:
                return self._judge(response, await response.aread())
            tokens: list[str] = []
            events = 0
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices", []):
                    tokens += _tokens(choice.get("delta", {}).get("content") or "")
                events += 1
                if leave_after is not None and events >= leave_after:
                    break  # leaving the block closes the connection mid-stream
            if not _is_prefix_sequence(tokens):
                self.report.duplicate_streams += 1
            if leave_after is not None and not done:
                return "client_left_stream"
            return "ok" if done else "stream_incomplete"

    async def _sdk_stream(self, i: int, sdk: openai.AsyncOpenAI, body: dict[str, Any]) -> str:
        stream = await sdk.chat.completions.create(
            model="sim-model", messages=body["messages"], stream=True, max_tokens=self.config.output_tokens
        )
        tokens: list[str] = []
        try:
            async for chunk in stream:
                self.started_streams.add(i)
                for choice in chunk.choices:
                    tokens += _tokens(choice.delta.content or "")
        finally:
            if not _is_prefix_sequence(tokens):
                self.report.duplicate_streams += 1
            await stream.close()
            self.started_streams.discard(i)
        return "ok"


def run_soak(config: SoakConfig, progress: Callable[[str], None] | None = None) -> SoakReport:
    unknown = {k for k, _ in config.kinds} - set(KINDS)
    if unknown:
        raise ValueError(f"unknown request kinds {sorted(unknown)}; known: {sorted(KINDS)}")
    report = SoakReport(config)
    sim_config = SimConfig(
        max_num_seqs=config.max_concurrency * 2,
        ttft=0.005,
        itl=0.001,
        output_tokens=config.long_output_tokens,
        error_rate=config.error_rate,
        reset_rate=config.reset_rate,
        slow_first_byte_rate=config.slow_first_byte_rate,
        slow_first_byte_delay=config.slow_first_byte_delay,
        stream_cut_rate=config.stream_cut_rate,
        seed=config.seed,
    )
    # log_level critical: every cut stream is, by design, an aborted ASGI response that uvicorn
    # logs with a traceback; the soak counts those outcomes itself.
    with ServerThread(create_sim_app(sim_config), log_level="critical") as sim:
        settings = ShimSettings(
            upstream=AnyHttpUrl(sim.url),
            max_concurrency=config.max_concurrency,
            max_queue=config.max_queue,
            max_queue_wait=config.max_queue_wait,
            log_level="warning",
        )
        # Idle pooled upstream connections close within the audit's settling time.
        app = create_app(settings, tuning=Tuning(upstream_keepalive=0.5))
        runtime = shim_state(app)
        with shim_server(app, timeout_keep_alive=1, log_level="critical") as shim:
            run = _Run(config, shim.url if config.through_shim else sim.url, report)
            asyncio.run(run.run(config.warmup, progress=None, measured=False))
            report.baseline = settle(shim, sim, runtime, None, config.settle_timeout)
            httpx.post(sim.url + "/sim/reset", timeout=10)
            counts_before = outcome_counts(metric_values(shim.url))
            if progress is not None:
                progress(f"soak: warm-up done, baseline {vars(report.baseline)}")
            started = time.monotonic()
            asyncio.run(run.run(config.requests, progress=progress, measured=True))
            report.seconds = time.monotonic() - started
            report.after = settle(shim, sim, runtime, report.baseline, config.settle_timeout)
            stats = httpx.get(sim.url + "/sim/stats", timeout=10).json()
            report.faults = {
                k.removeprefix("injected_"): int(v) for k, v in stats.items() if k.startswith("injected_")
            }
            report.waiting_futures_after = int(on_loop(shim, lambda: runtime.admission.waiting))
            values = metric_values(shim.url)
            report.gauges_after = {
                k: v
                for k, v in values.items()
                if k.startswith(("llm_backoff_shim_in_flight", "llm_backoff_shim_queue_depth"))
            }
            report.bad_requests = {
                k.split("reason=", 1)[1]: v
                for k, v in values.items()
                if k.startswith("llm_backoff_shim_bad_requests_total") and v
            }
            report.shim_counts = {
                k: v - counts_before.get(k, 0.0)
                for k, v in outcome_counts(values).items()
                if v - counts_before.get(k, 0.0)
            }
    return report
