"""The load generator: real openai clients, one logical call per arrival, every HTTP attempt recorded.

One run drives a list of :class:`~llm_backoff_shim.lab.scenario.Arrival` against one
base URL with one kind of client, and returns a :class:`RunResult` with:

- a :class:`CallRecord` per call: class, start, time of the first content token,
  end, outcome (``ok`` / ``error`` with the typed error's description /
  ``deadline``), and its HTTP attempts;
- an :class:`AttemptRecord` per HTTP attempt (sent, response headers received,
  status), captured by :class:`CountingTransport`, which sits *below* openai's own
  retry loop and below llm_backoff's retrying transport, so every attempt of either
  is seen. It finds the call an attempt belongs to through a context variable: the
  transport runs in the task of the call that sends;
- :class:`Sample` s of the engine's and the proxy's queues, polled every ~200 ms;
- optionally, the shim's own view of each attempt: every attempt carries an
  ``x-request-id`` (``<call>-<attempt>``), the shim logs it in its access log, and
  :func:`attach_shim_times` puts the shim's ``total_ms`` (arrival to answer, measured
  inside the shim) next to the client-side latency, which includes the load
  generator's own event-loop lag;
- the simulator's own accounting for the run (``/sim/stats`` after ``/sim/reset``).

Calls stream (``stream_options.include_usage``) so that time to first token is
measured the way an interactive user feels it. Each call is cut at its deadline by
the caller (``asyncio.wait_for``), whatever the client does: a caller who gave up
closes its connection, and the engine's work for it shows up as wasted.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import importlib
import json
import signal
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import openai

from llm_backoff import RetryPolicy, wrap
from llm_backoff.budget import RetryBudget
from llm_backoff_shim.lab.loadgen_engine import EngineProbe
from llm_backoff_shim.lab.scenario import Arrival, RequestClass, Scenario, Setup
from llm_backoff_shim.serve.access_log import json_records

Outcome = Literal["ok", "error", "deadline"]
REJECT_STATUSES = frozenset({429, 503})
SAMPLE_EVERY = 0.2
PROGRESS_EVERY = 1.0


@dataclass
class AttemptRecord:
    number: int
    sent: float
    """When the attempt reached the bottom of the client's stack (before a connection is taken)."""
    answered: float | None = None
    """When the response's head had been read off the connection."""
    status: int | None = None
    error: str | None = None
    code: str | None = None
    """``error.code`` of an error answer (``queue_full``, ``queue_timeout``...), when it has one."""
    shim_seconds: float | None = None
    """The shim's own arrival-to-answer time for this attempt (its access log), when known."""
    shim_body_seconds: float | None = None
    """Of :attr:`shim_seconds`, the time from the request's head to its body read in full
    (the access log's ``body_ms``): waiting for the client to send it, when known."""
    written: float | None = None
    """When the request's head started going onto its connection (the HTTP library's trace
    events); None when the library did not report it."""
    body_sent: float | None = None
    """When the request's last byte (its body) had been written to its connection; None when
    the library did not report it. From ``written`` to here is this process's own doing."""

    @property
    def rejected(self) -> bool:
        return self.status in REJECT_STATUSES

    @property
    def latency(self) -> float | None:
        """Seconds from the request's last byte written to having read the response's head (None
        when no response came): the wire's round trip plus the server's time, plus this
        process's own event-loop lag in noticing the answer. From the head's write
        (:attr:`latency_from_head`) when the last byte was not traced.

        Not from the head: the HTTP library writes a request's head and body in two writes,
        and under a burst this process's event loop runs other calls between them (up to
        tens of ms, docs/history/benchmarks-diary.md, 'the 2x time to rejection, split'); a server cannot
        answer a request it has not been sent yet."""
        if self.answered is None:
            return None
        return self.answered - self.body_sent if self.body_sent is not None else self.latency_from_head

    @property
    def latency_from_head(self) -> float | None:
        """Seconds from the request's head starting onto the wire (from ``sent`` when that
        was not traced) to having read the response's head; None when no response came."""
        if self.answered is None:
            return None
        return self.answered - (self.sent if self.written is None else self.written)


@dataclass
class CallRecord:
    """One logical call. ``tokens``/``prompt_tokens``: the answer's ``usage`` (the tokens
    streamed, when no usage came); ``ttft_budget`` None means the deadline."""

    index: int
    cls: RequestClass
    scheduled: float
    deadline: float
    start: float = 0.0
    first_token: float | None = None
    end: float | None = None
    outcome: Outcome | None = None
    error: str | None = None
    tokens: int = 0
    attempts: list[AttemptRecord] = field(default_factory=list)
    ttft_budget: float | None = None
    max_tokens: int | None = None
    prompt_tokens: int = 0
    streamed: int = 0
    """Content chunks received (about one token each); what a caller who left got."""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def within_budget(self) -> bool:
        """Completed before its deadline, its first token within its TTFT budget."""
        if not self.ok or self.ttft is None:
            return False
        budget = self.deadline if self.ttft_budget is None else self.ttft_budget
        return self.ttft <= budget

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


@dataclass(frozen=True)
class Sample:
    t: float
    engine_running: int | None
    engine_waiting: int | None
    proxy_queued: int | None
    proxy_in_flight: int | None


@dataclass
class RunResult:
    """``engine_stats``: the simulator's ``/sim/stats`` after the run, or for another engine
    (vLLM) ``tokens_generated`` (its ``vllm:generation_tokens_total`` over the run) and
    ``aborted_tokens`` (those not delivered in a completed answer). ``token_capacity``:
    answer tokens/s the engine sustains (None: unknown), for the useful-token ceiling."""

    setup: Setup
    scenario: Scenario
    capacity: float
    calls: list[CallRecord]
    samples: list[Sample]
    engine_stats: dict[str, Any]
    elapsed: float
    token_capacity: float | None = None


@dataclass(frozen=True)
class Progress:
    t: float
    sent: int
    total: int
    ok: int
    failed: int
    active: int
    attempts: int
    engine_waiting: int | None
    proxy_queued: int | None


_CURRENT_CALL: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar(
    "llm_backoff_shim_loadgen_call", default=None
)


def http_library() -> ModuleType:
    """``httpx2`` for openai 3.x, ``httpx`` for openai 2.x: the library openai's clients are built on."""
    for klass in openai.DefaultAsyncHttpxClient.__mro__:
        root = klass.__module__.split(".", 1)[0]
        if root in ("httpx2", "httpx"):
            return importlib.import_module(root)
    raise RuntimeError("cannot tell which HTTP library this openai version uses")


def bind_call(record: CallRecord) -> None:
    """Attribute the HTTP attempts made from now on in this task (context) to ``record``."""
    _CURRENT_CALL.set(record)


class CountingTransport:
    """Records every HTTP attempt on the current call, then hands the request on.

    Duck-typed (``handle_async_request``/``aclose``) rather than subclassing one
    library's base class, so the same class serves httpx and httpx2 clients.
    """

    def __init__(self, inner: Any, clock: Callable[[], float], byte_stream: Callable[[bytes], Any]) -> None:
        self.inner = inner
        self._clock = clock
        self._byte_stream = byte_stream

    async def handle_async_request(self, request: Any) -> Any:
        call = _CURRENT_CALL.get()
        record: AttemptRecord | None = None
        if call is not None:
            record = AttemptRecord(number=len(call.attempts) + 1, sent=self._clock())
            call.attempts.append(record)
            # Lets the shim's access log be matched with this attempt (attach_shim_times).
            request.headers["x-request-id"] = attempt_id(call.index, record.number)
            request.extensions["trace"] = _AttemptTrace(record, self._clock, request.extensions.get("trace"))
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException as exc:
            if record is not None:
                record.error = type(exc).__name__
            raise
        if record is not None:
            if record.answered is None:
                record.answered = self._clock()
            record.status = response.status_code
            if response.status_code >= 400:
                # Error bodies are small: read the raw bytes here and hand the layers
                # above a replayable stream of the same bytes.
                stream = response.stream
                try:
                    raw = b"".join([chunk async for chunk in stream])
                finally:
                    await stream.aclose()
                response.stream = self._byte_stream(raw)
                record.code = error_code(raw)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> CountingTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _AttemptTrace:
    """httpcore's ``trace`` extension for one attempt: stamps the write and the read.

    The time to a rejection is then taken from the moment the request goes onto the
    wire, not from when the client's task got round to sending it (taking a pooled
    connection or opening one, which under a burst waits for this process's busy event
    loop); the answer is stamped as soon as its head is parsed. A trace callback the
    caller set is still called. A retry loop may send the same request object again: the
    previous attempt's trace is then replaced, not chained, or its record would be
    stamped with the next attempt's times.
    """

    def __init__(self, record: AttemptRecord, clock: Callable[[], float], chained: Any) -> None:
        self._record = record
        self._clock = clock
        self._chained: Any = chained._chained if isinstance(chained, _AttemptTrace) else chained

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith("send_request_headers.started"):
            self._record.written = self._clock()
        elif event.endswith("send_request_body.complete"):
            self._record.body_sent = self._clock()
        elif event.endswith("receive_response_headers.complete"):
            self._record.answered = self._clock()
        if self._chained is not None:
            await self._chained(event, info)


def attempt_id(call: int, attempt: int) -> str:
    """The ``x-request-id`` the load generator sends with attempt ``attempt`` of call ``call``."""
    return f"{call}-{attempt}"


def attach_shim_times(calls: Sequence[CallRecord], access_log: str) -> int:
    """Fill :attr:`AttemptRecord.shim_seconds` from a shim's JSON access log; returns how many matched.

    Lines that are not JSON access records (start-up messages, other loggers) are skipped.
    """
    seen: dict[str, tuple[float, float | None]] = {}
    for entry in json_records(access_log):
        rid, total, body = entry.get("request_id"), entry.get("total_ms"), entry.get("body_ms")
        if isinstance(rid, str) and isinstance(total, (int, float)):
            read = float(body) / 1000.0 if isinstance(body, (int, float)) else None
            seen[rid] = (float(total) / 1000.0, read)
    matched = 0
    for call in calls:
        for attempt in call.attempts:
            found = seen.get(attempt_id(call.index, attempt.number))
            if found is not None:
                attempt.shim_seconds, attempt.shim_body_seconds = found
                matched += 1
    return matched


def error_code(body: bytes) -> str | None:
    """``error.code`` of an OpenAI-format error body, or None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def describe_error(exc: BaseException) -> str:
    """A short, typed description: ``429 queue_full``, ``503``, ``connection error``...

    `` (start deadline)`` is added when ``llm_backoff`` gave up on the call's start deadline
    (its note on the error says so): the answer could not have begun within the caller's
    TTFT budget. Such a call failed fast, with a typed error, like any other here.
    """
    text = _describe(exc)
    notes = getattr(exc, "__notes__", None) or ()
    if any("start deadline" in str(note) for note in notes):
        text += " (start deadline)"
    return text


def _describe(exc: BaseException) -> str:
    if isinstance(exc, openai.APIStatusError):
        code = exc.code
        if code is None and isinstance(exc.body, dict):
            code = exc.body.get("code")
        return f"{exc.status_code} {code}" if code else str(exc.status_code)
    if isinstance(exc, openai.APITimeoutError):
        return "client timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection error"
    return type(exc).__name__


def _budget(scenario: Scenario) -> RetryBudget:
    # One retry per first attempt, remembered for a whole call deadline: enough for a
    # caller to come back at its Retry-After, not enough for a fleet to double again.
    return RetryBudget(ratio=1.0, min_per_second=2.0, ttl=scenario.longest_deadline)


def retry_policy(cls: RequestClass, scenario: Scenario, *, start_deadline: bool = True) -> RetryPolicy:
    """The ``llm_backoff`` policy of a caller of ``cls``: the call's deadline, and for an
    interactive caller (``start_deadline``) its time-to-first-token budget as the time the
    answer must begin by. That is a caller stating a budget it knows, not a tuning: the SDK
    then sends what is left of it as ``x-request-timeout-ms``, so the shim refuses at once a
    request that cannot start in time, and no retry waits past it. Batch callers have no
    such budget. Plain openai callers have no such knob."""
    deadline = scenario.deadline_of(cls)
    if start_deadline and cls == "interactive":
        return RetryPolicy(deadline=deadline, start_deadline=scenario.ttft_budget)
    return RetryPolicy(deadline=deadline)


def build_clients(
    setup: Setup, scenario: Scenario, base_url: str, http_client: Any, *, start_deadline: bool = True
) -> dict[RequestClass, openai.AsyncOpenAI]:
    """One openai client per class, all sharing ``http_client`` (and its counting transport).

    ``start_deadline``: interactive ``llm_backoff`` callers state their TTFT budget
    (:func:`retry_policy`); off, they have the call's deadline only (the reference
    to compare ``start_deadline`` against).
    """
    budget = _budget(scenario)
    clients: dict[RequestClass, openai.AsyncOpenAI] = {}
    classes: tuple[RequestClass, ...] = ("interactive", "batch")
    for cls in classes:
        if setup.client == "plain":
            # What a team writes today: the defaults (2 retries), the deadline as timeout,
            # and the class header, which any client can send and the engine ignores.
            clients[cls] = openai.AsyncOpenAI(
                base_url=base_url + "/v1",
                api_key="demo",
                http_client=http_client,
                timeout=scenario.deadline_of(cls),
                default_headers={"x-request-class": cls},
            )
        else:
            raw = openai.AsyncOpenAI(
                base_url=base_url + "/v1",
                api_key="demo",
                http_client=http_client,
                timeout=scenario.deadline_of(cls),
            )
            if setup.client == "llm_backoff_presets":
                clients[cls] = wrap(raw, request_class=cls, budget=budget)  # the class's preset
            else:
                policy = retry_policy(cls, scenario, start_deadline=start_deadline)
                clients[cls] = wrap(raw, policy, request_class=cls, budget=budget)
    return clients


class LoadRun:
    """One configuration against one scenario; :meth:`run` returns the records.

    ``engine_url`` is the engine behind everything (the simulator or a vLLM): it is
    sampled for its queue (``/sim/stats``, else ``/metrics``) and its token counters are
    read around the run. ``model`` is what every call asks for. ``token_capacity``
    (answer tokens/s at full load) is passed through to the result.
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
    ) -> None:
        self.setup = setup
        self.token_capacity = token_capacity
        self.scenario = scenario
        self.arrivals = list(arrivals)
        self.target_url = target_url
        self.engine_url = engine_url
        self.shim_url = shim_url
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
            probe = EngineProbe(client, self.engine_url)
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

    async def _stream(self, client: openai.AsyncOpenAI, record: CallRecord, arrival: Arrival) -> None:
        extra: dict[str, Any] = {}
        if arrival.max_tokens is not None:
            extra["max_tokens"] = arrival.max_tokens
        if arrival.ignore_eos:
            extra["extra_body"] = {"ignore_eos": True}
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

    async def _sample(self, probe: EngineProbe) -> None:
        while True:
            started = self.clock()
            running, waiting = await probe.occupancy()
            queued = in_flight = None
            if self.shim_url is not None and self.setup.route == "shim":
                state = await probe.get_json(self.shim_url + "/shim/state")
                if state is not None:
                    classes = state.get("classes", {}).values()
                    queued = sum(int(c.get("queued", 0)) for c in classes)
                    in_flight = sum(int(c.get("in_flight", 0)) for c in classes)
            # Stamped when the answers are in: under a burst the poll itself can wait
            # a while for the event loop, and the state it reports is the later one.
            self.samples.append(Sample(self.clock(), running, waiting, queued, in_flight))
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


async def _within(call: Coroutine[Any, Any, None], seconds: float) -> None:
    """Run ``call`` in the current task, cut after ``seconds`` (``TimeoutError``).

    Not ``asyncio.wait_for``: on Python 3.11 it runs the call in a task of its own,
    scheduled behind every task ready at that moment, and the call's deadline runs
    meanwhile. In a burst of 200 calls, the time from a call's start to its first attempt
    reaching the transport was 271 ms (median) with this and 326 ms without
    (docs/history/benchmarks-diary.md, 'a hint is a reservation'). The rest is the openai client's own
    work before it sends, interleaved with the other calls'.
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
    of bench/bench_overload.py), during which no answer was read and every call in flight was
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
