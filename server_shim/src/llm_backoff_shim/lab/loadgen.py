"""The load generator: real openai clients, one logical call per arrival, every HTTP attempt recorded.

One run drives a list of :class:`~llm_backoff_shim.lab.scenario.Arrival` against one
base URL with one kind of client (:mod:`llm_backoff_shim.lab.callers`), and returns a
:class:`~llm_backoff_shim.lab.load_records.RunResult` with:

- a :class:`~llm_backoff_shim.lab.load_records.CallRecord` per call: class, start, time
  of the first content token, end, outcome (``ok`` / ``error`` with the typed error's
  description / ``deadline``), and its HTTP attempts, each captured by
  :class:`~llm_backoff_shim.lab.attempt_capture.CountingTransport`;
- :class:`~llm_backoff_shim.lab.load_records.Sample` s of the engine's and the proxy's
  queues, polled every ~200 ms;
- the simulator's own accounting for the run (``/sim/stats`` after ``/sim/reset``).

Calls stream (``stream_options.include_usage``) so that time to first token is
measured the way an interactive user feels it. Each call is cut at its deadline by
the caller (``asyncio.wait_for``), whatever the client does: a caller who gave up
closes its connection, and the engine's work for it shows up as wasted.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import openai

from llm_backoff_shim.lab.attempt_capture import CountingTransport, bind_call, describe_error, http_library
from llm_backoff_shim.lab.callers import build_clients
from llm_backoff_shim.lab.load_records import CallRecord, Progress, RunResult, Sample
from llm_backoff_shim.lab.loadgen_engine import EngineProbe, FleetProbe
from llm_backoff_shim.lab.scenario import Arrival, RequestClass, Scenario, Setup

SAMPLE_EVERY = 0.2
PROGRESS_EVERY = 1.0


class LoadRun:
    """One configuration against one scenario; :meth:`run` returns the records.

    ``engine_url`` is the engine behind everything (the simulator or a vLLM): it is
    sampled for its queue (``/sim/stats``, else ``/metrics``) and its token counters are
    read around the run. ``model`` is what every call asks for. ``token_capacity``
    (answer tokens/s at full load) is passed through to the result.

    A fleet (several engines, each with a shim, behind one load balancer at ``target_url``):
    ``engine_urls`` and ``shim_urls`` name them all, in replica order (``engine_url`` and
    ``shim_url`` are then ignored). Samples and token counts are summed over the replicas,
    and each sample keeps every replica's own figures (:attr:`Sample.replicas`).
    """

    def __init__(
        self,
        setup: Setup,
        scenario: Scenario,
        arrivals: Sequence[Arrival],
        *,
        target_url: str,
        engine_url: str,
        capacity: float,
        shim_url: str | None = None,
        model: str = "sim-model",
        progress: Callable[[Progress], None] | None = None,
        start_deadline: bool = True,
        token_capacity: float | None = None,
        engine_urls: Sequence[str] = (),
        shim_urls: Sequence[str] = (),
    ) -> None:
        self.setup = setup
        self.token_capacity = token_capacity
        self.scenario = scenario
        self.arrivals = list(arrivals)
        self.target_url = target_url
        self.engine_url = engine_url
        self.shim_url = shim_url
        self.engine_urls = list(engine_urls)
        self.shim_urls = list(shim_urls) if shim_urls else ([shim_url] if shim_url is not None else [])
        if self.engine_urls:
            self.engine_url = self.engine_urls[0]
        self.capacity = capacity
        self.model = model
        self._progress = progress
        self.start_deadline = start_deadline
        self._origin = 0.0
        self.calls: list[CallRecord] = []
        self.samples: list[Sample] = []
        self._sent = 0

    def clock(self) -> float:
        return time.monotonic() - self._origin

    async def run(self) -> RunResult:
        http = http_library()
        # Unbounded pool: straight at the engine every waiting caller holds a connection,
        # and a pool limit would queue them in the client instead of in the engine.
        limits = http.Limits(max_connections=None, max_keepalive_connections=64)
        transport = CountingTransport(http.AsyncHTTPTransport(limits=limits), self.clock, http.ByteStream)
        async with http.AsyncClient(timeout=5.0) as client, http.AsyncClient(transport=transport) as shared:
            probe: EngineProbe | FleetProbe = (
                FleetProbe(client, self.engine_urls)
                if self.engine_urls
                else EngineProbe(client, self.engine_url)
            )
            await self._warm_up(shared)
            await probe.reset()
            clients = build_clients(
                self.setup, self.scenario, self.target_url, shared, start_deadline=self.start_deadline
            )
            self._origin = time.monotonic()
            sampler = asyncio.create_task(self._sample(probe))
            reporter = asyncio.create_task(self._report())
            try:
                await self._drive(clients)
            finally:
                sampler.cancel()
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
            elapsed = self.clock()
            delivered = sum(c.tokens for c in self.calls if c.ok)
            stats = await probe.settled_stats(delivered)
        return RunResult(
            self.setup,
            self.scenario,
            self.capacity,
            self.calls,
            self.samples,
            stats,
            elapsed,
            self.token_capacity,
        )

    async def _drive(self, clients: dict[RequestClass, openai.AsyncOpenAI]) -> None:
        tasks: set[asyncio.Task[None]] = set()
        try:
            for arrival in self.arrivals:
                delay = arrival.at - self.clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                record = CallRecord(
                    arrival.index,
                    arrival.cls,
                    arrival.at,
                    self.scenario.deadline_of(arrival.cls),
                    ttft_budget=self.scenario.ttft_budget_of(arrival.cls),
                    max_tokens=arrival.max_tokens,
                )
                self.calls.append(record)
                self._sent += 1
                tasks.add(asyncio.create_task(self._call(clients[arrival.cls], record, arrival)))
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _call(self, client: openai.AsyncOpenAI, record: CallRecord, arrival: Arrival) -> None:
        bind_call(record)  # each task runs in its own copy of the context
        record.start = self.clock()
        try:
            await _within(self._stream(client, record, arrival), record.deadline)
        except asyncio.TimeoutError:
            record.outcome = "deadline"
            record.error = f"deadline ({record.deadline:g} s)"
        except Exception as exc:
            record.outcome = "error"
            record.error = describe_error(exc)
        else:
            record.outcome = "ok"
        record.end = self.clock()
        if record.outcome == "ok" and record.end - record.start > record.deadline:
            # The timer fires on the event loop: behind a busy loop an answer can end past the
            # deadline before the cut is delivered. Past its deadline a call is late, whatever came.
            record.outcome = "deadline"
            record.error = f"deadline ({record.deadline:g} s)"

    async def _stream(self, client: openai.AsyncOpenAI, record: CallRecord, arrival: Arrival) -> None:
        extra: dict[str, Any] = {}
        if arrival.max_tokens is not None:
            extra["max_tokens"] = arrival.max_tokens
        if arrival.ignore_eos:
            extra["extra_body"] = {"ignore_eos": True}
        if arrival.api_key is not None:
            extra["extra_headers"] = {"Authorization": f"Bearer {arrival.api_key}"}
        stream = await client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": arrival.prompt or f"call {record.index}"}],
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
        async with stream:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    record.streamed += 1
                    if record.first_token is None:
                        record.first_token = self.clock()
                    if arrival.answer_tokens is not None and record.streamed >= arrival.answer_tokens:
                        break  # the answer is complete: closing the stream aborts the rest
                if chunk.usage is not None:
                    record.tokens = chunk.usage.completion_tokens
                    record.prompt_tokens = chunk.usage.prompt_tokens
        if record.tokens == 0:
            record.tokens = record.streamed

    # -- side channels ------------------------------------------------------------------

    async def _warm_up(self, http_client: Any) -> None:
        # openai builds its resources and response models on first use; paying that
        # inside the burst would show up as tens of ms of client lag on every call.
        client = openai.AsyncOpenAI(
            base_url=self.engine_url + "/v1", api_key="demo", http_client=http_client, max_retries=0
        )
        stream = await client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "warm-up"}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=1,
        )
        async with stream:
            async for _ in stream:
                pass

    async def _sample(self, probe: EngineProbe | FleetProbe) -> None:
        sample_shims = bool(self.shim_urls) and self.setup.route == "shim"
        while True:
            started = self.clock()
            running, waiting = await probe.occupancy()
            shims: list[tuple[int | None, int | None]] = []
            states: list[dict[str, Any] | None] = []
            if sample_shims:
                states = await asyncio.gather(
                    *(probe.get_json(url + "/shim/state") for url in self.shim_urls)
                )
                shims = [_shim_load(state) for state in states]
            queued = in_flight = None
            if shims and all(q is not None for q, _f in shims):
                queued = sum(q or 0 for q, _f in shims)
                in_flight = sum(f or 0 for _q, f in shims)
            replicas: tuple[tuple[int | None, int | None, int | None, int | None], ...] = ()
            if isinstance(probe, FleetProbe):
                shim_of = shims or [(None, None)] * len(probe.last)
                replicas = tuple((r, w, q, f) for (r, w), (q, f) in zip(probe.last, shim_of, strict=False))
            # Stamped when the answers are in: under a burst the poll itself can wait
            # a while for the event loop, and the state it reports is the later one.
            tokens, by_class = _shim_cost(states)
            self.samples.append(
                Sample(self.clock(), running, waiting, queued, in_flight, replicas, tokens, by_class)
            )
            await asyncio.sleep(max(0.0, SAMPLE_EVERY - (self.clock() - started)))

    async def _report(self) -> None:
        if self._progress is None:
            return
        while True:
            await asyncio.sleep(PROGRESS_EVERY)
            self._progress(self.progress())

    def progress(self) -> Progress:
        done = [c for c in self.calls if c.outcome is not None]
        last = self.samples[-1] if self.samples else None
        return Progress(
            t=self.clock(),
            sent=self._sent,
            total=len(self.arrivals),
            ok=sum(1 for c in done if c.ok),
            failed=sum(1 for c in done if not c.ok),
            active=self._sent - len(done),
            attempts=sum(len(c.attempts) for c in self.calls),
            engine_waiting=None if last is None else last.engine_waiting,
            proxy_queued=None if last is None else last.proxy_queued,
        )


def _shim_load(state: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """(queued, in flight) over every class of a shim's ``/shim/state``; None, None if unread."""
    if state is None:
        return None, None
    classes = state.get("classes", {}).values()
    return sum(int(c.get("queued", 0)) for c in classes), sum(int(c.get("in_flight", 0)) for c in classes)


def _shim_cost(states: Sequence[dict[str, Any] | None]) -> tuple[int | None, dict[str, int]]:
    """The cost in flight (None unless every shim reports one) and the requests in flight per
    class, summed over the shims' ``/shim/state``."""
    tokens: int | None = 0 if states else None
    by_class: dict[str, int] = {}
    for state in states:
        if state is None:
            return None, {}
        held = state.get("in_flight_tokens")
        tokens = None if held is None or tokens is None else tokens + int(held)
        for cls, c in state.get("classes", {}).items():
            by_class[cls] = by_class.get(cls, 0) + int(c.get("in_flight", 0))
    return tokens, by_class


async def _within(call: Coroutine[Any, Any, None], seconds: float) -> None:
    """Run ``call`` in the current task, cut after ``seconds`` (``TimeoutError``).

    Not ``asyncio.wait_for``: on Python 3.11 it runs the call in a task of its own,
    scheduled behind every task ready at that moment, and the call's deadline runs
    meanwhile. In a burst of 200 calls, the time from a call's start to its first attempt
    reaching the transport was 271 ms (median) with this and 326 ms without. The rest is the
    openai client's own work before it sends, interleaved with the other calls'.
    """
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10: wait_for is all there is
        await asyncio.wait_for(call, seconds)
        return
    async with timeout(seconds):
        await call


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it comes with ``uvicorn[standard]``): the load generator's own
    overhead then distorts the measured latencies less; the stdlib loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """The process's heap so far (openai, pydantic, matplotlib, earlier runs' records) left out of
    the cyclic GC's passes while the load runs, as the shim does at start-up (``serve.tune_gc``).

    Why: a full collection walked all of it, 34-88 ms per pass (``gc.callbacks``, a 1.2x run
    of bench/bench_overload.py at 658ce04), during which no answer was read and every call in flight was
    timed that much slower: the load generator's own pause, not the server's. Unfrozen after,
    so what the run left behind can be collected later.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_load(run: LoadRun) -> RunResult:
    """Run ``run`` in a fresh event loop (a synchronous entry point for the CLI and the benchmark).

    Ctrl-C and SIGTERM cancel the run through the loop's own signal handling (a plain
    Python handler raising inside uvloop's callbacks can be lost) and then surface as
    KeyboardInterrupt, so the caller's ``finally`` clauses stop the servers.
    """
    loop = new_event_loop()
    main = loop.create_task(run.run())
    interrupted: list[int] = []

    def interrupt(signum: int) -> None:
        interrupted.append(signum)
        main.cancel()

    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            handler = signal.getsignal(sig)
            loop.add_signal_handler(sig, interrupt, sig)
            previous[sig] = handler
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or no signals here: Ctrl-C then works as usual
    try:
        with _heap_frozen():
            return loop.run_until_complete(main)
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)
            # remove_signal_handler installs the default; put back what was there before.
            signal.signal(signum, handler)
        # What asyncio.run does on the way out: no task is left behind.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
