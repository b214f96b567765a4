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

Audit after the load (:mod:`llm_backoff_shim.lab.soak_audit`; its findings are a
:class:`~llm_backoff_shim.lab.soak_report.SoakReport`), once clients are closed and idle
connections have expired: shim gauges (controller, ``/metrics``) at zero, no future left
waiting, asyncio tasks and file descriptors back to their post-warm-up baseline, and
resident memory growth measured against the post-warm-up figure (the caller decides the
bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
from pydantic import AnyHttpUrl

import llm_backoff
from llm_backoff_shim.lab.soak_audit import metric_values, on_loop, outcome_counts, rss_mib, settle
from llm_backoff_shim.lab.soak_report import KINDS, SoakConfig, SoakReport
from llm_backoff_shim.serve.app import create_app, shim_state
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.tuning import Tuning
from llm_backoff_shim.serve.serving import ServerThread, shim_server
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

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
