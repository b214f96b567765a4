"""The demo's building blocks: arrivals, figures, the attempt-counting transport, one real run each way."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import random
import sys
from typing import Any

import httpx2
import openai
import pytest

from llm_backoff import RetryPolicy, wrap
from llm_backoff_shim.lab import loadgen
from llm_backoff_shim.lab.attempt_capture import CountingTransport, bind_call, describe_error, http_library
from llm_backoff_shim.lab.callers import build_clients, retry_policy
from llm_backoff_shim.lab.figures import figures, max_in_window, percentile
from llm_backoff_shim.lab.load_records import AttemptRecord, CallRecord, RunResult, Sample
from llm_backoff_shim.lab.loadgen import LoadRun
from llm_backoff_shim.lab.procs import ChildServer, ServerStartError
from llm_backoff_shim.lab.report import comparison, explained_comparison, reading, table
from llm_backoff_shim.lab.scenario import (
    DIRECT_PLAIN,
    SHIM_BACKOFF,
    EngineShape,
    Scenario,
    arrivals,
)
from llm_backoff_shim.serve.app import create_app
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.serving import ServerThread, shim_server
from llm_backoff_shim.sim.engine import EngineParams, SimEngine
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

# -- scenario -------------------------------------------------------------------------------


def test_engine_capacity_is_slots_over_service_time() -> None:
    shape = EngineShape(slots=8, ttft=0.25, itl=0.05, output_tokens=20)
    assert shape.service_time == pytest.approx(1.2)
    assert shape.capacity == pytest.approx(8 / 1.2)
    flags = shape.sim_flags()
    assert flags[flags.index("--itl-batch-factor") + 1] == "0"


def test_service_time_matches_the_simulated_engine() -> None:
    """The printed capacity must be the engine's real one: drive the sim's scheduler on a fake clock."""
    shape = EngineShape()
    now = [0.0]
    engine = SimEngine(
        EngineParams(max_num_seqs=shape.slots, ttft=shape.ttft, itl=shape.itl, itl_batch_factor=0.0),
        lambda: now[0],
    )
    seqs = [engine.add(f"r{i}", max_tokens=shape.output_tokens) for i in range(shape.slots * 3)]
    while (due := engine.next_event_time()) is not None:
        now[0] = due
        engine.step()
    finished = [s.finished_at for s in seqs]
    assert all(t is not None for t in finished)
    # Three full batches back to back: the last one ends at 3 service times.
    assert max(t for t in finished if t is not None) == pytest.approx(3 * shape.service_time)
    assert engine.stats.requests_completed == 3 * shape.slots


def test_arrivals_are_reproducible_and_shaped_like_the_scenario() -> None:
    scenario = Scenario("t", burst=30, rate_factor=2.0, duration=20.0, deadline=10, ttft_budget=5)
    a = arrivals(scenario, 10.0, random.Random(3))
    assert a == arrivals(scenario, 10.0, random.Random(3))
    assert a != arrivals(scenario, 10.0, random.Random(4))
    assert [x.at for x in a[:30]] == [0.0] * 30
    poisson = a[30:]
    assert all(0 < x.at < 20.0 for x in poisson)
    assert [x.at for x in poisson] == sorted(x.at for x in poisson)
    # 20 arrivals/s for 20 s: 400 expected; a Poisson count stays far inside +-20 %.
    assert 320 < len(poisson) < 480
    share = sum(x.cls == "interactive" for x in a) / len(a)
    assert 0.6 < share < 0.8
    assert [x.index for x in a] == list(range(len(a)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"burst": 0, "rate_factor": 0.0, "duration": 5.0},
        {"burst": -1},
        {"deadline": 0.0},
        {"ttft_budget": 20.0},
        {"interactive_share": 1.5},
        {"rate_factor": float("nan")},
    ],
)
def test_bad_scenarios_are_refused(kwargs: dict[str, Any]) -> None:
    base: dict[str, Any] = {
        "burst": 1,
        "rate_factor": 1.0,
        "duration": 1.0,
        "deadline": 10.0,
        "ttft_budget": 5.0,
    }
    with pytest.raises(ValueError, match=r"must|no load"):
        Scenario("bad", **{**base, **kwargs})


# -- report ---------------------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0
    assert percentile([], 50) is None


def test_max_in_window_counts_the_densest_100ms() -> None:
    assert max_in_window([]) == 0
    assert max_in_window([0.0, 0.05, 0.099, 0.1, 0.5]) == 3
    assert max_in_window([0.0, 0.125, 0.25, 0.375], window=0.125) == 1  # half-open windows
    assert max_in_window([1.0] * 7 + [2.0]) == 7


def _call(index: int, cls: str, outcome: str, *attempts: AttemptRecord, **kw: Any) -> CallRecord:
    record = CallRecord(index, cls, 0.0, 10.0, **kw)  # type: ignore[arg-type]
    record.outcome = outcome  # type: ignore[assignment]
    record.attempts.extend(attempts)
    return record


def test_figures_from_known_records() -> None:
    calls = [
        # admitted at once, TTFT 0.5 s
        _call(0, "interactive", "ok", AttemptRecord(1, 0.0, 0.01, 200), start=0.0, first_token=0.5, end=1.2),
        # rejected (20 ms), admitted on its first retry, TTFT 2.5 s
        _call(
            1,
            "interactive",
            "ok",
            AttemptRecord(1, 0.0, 0.02, 429, code="queue_full"),
            AttemptRecord(2, 2.0, 2.01, 200),
            start=0.0,
            first_token=2.5,
            end=3.2,
        ),
        # rejected twice (5 ms each), then gave up with a typed error
        _call(
            2,
            "batch",
            "error",
            AttemptRecord(1, 0.0, 0.005, 429, code="queue_full"),
            AttemptRecord(2, 2.04, 3.045, 429, code="queue_timeout"),
            start=0.0,
            end=2.05,
            error="429 queue_full",
        ),
        # ran into its deadline
        _call(3, "batch", "deadline", AttemptRecord(1, 0.0), start=0.0, end=10.0, error="deadline (10 s)"),
    ]
    result = RunResult(
        SHIM_BACKOFF,
        Scenario("t", burst=4, rate_factor=0, duration=0, deadline=10, ttft_budget=4),
        capacity=2.0,
        calls=calls,
        samples=[Sample(0.0, 1, 3, 2, 1), Sample(0.2, 2, 0, 5, 2)],
        engine_stats={"tokens_generated": 100, "aborted_tokens": 25},
        elapsed=10.0,
    )
    f = figures(result)
    assert (f.calls, f.ok, f.failed_fast, f.failed_deadline) == (4, 2, 1, 1)
    assert f.deadline_while_served == 0  # the one at its deadline never got a token
    assert f.success_rate == 0.5
    assert (f.ttft_p50, f.ttft_p99) == (0.5, 2.5)
    assert f.rejections == 3
    assert f.rejection_p50 == pytest.approx(0.02)
    assert f.rejection_p99 == pytest.approx(1.005)  # the one that waited in the queue
    assert f.queue_full_p99 == pytest.approx(0.02)
    assert f.rejections_by_code == {"429 queue_full": 2, "429 queue_timeout": 1}
    assert (f.attempts, f.retries) == (6, 2)
    assert f.attempts_per_success == 3.0
    assert f.retry_wave == 2  # retries at 2.0 and 2.04 s
    assert (f.first_retries, f.first_retry_admitted) == (2, 0.5)
    assert f.run_span == 10.0
    assert f.goodput == pytest.approx(0.2)
    assert f.goodput_fraction == pytest.approx(0.1)
    assert (f.wasted_tokens, f.wasted_fraction) == (25, 0.25)
    assert (f.engine_peak_waiting, f.proxy_peak_queued) == (3, 5)
    assert f.errors == {"429 queue_full": 1, "deadline (10 s)": 1}
    assert f.median_time_to_fail_fast == pytest.approx(2.05)
    text = table(f)
    assert "2/4 = 50%" in text
    assert "25/100 tokens = 25%" in text
    assert "2 retries in 100 ms" in text
    side = comparison([f, f])
    assert side.count(SHIM_BACKOFF.label) == 2
    assert "1 / 1" in side
    # Where a configuration had nothing refused, its "-" is said where it is printed.
    unrefused = dataclasses.replace(f, label="none refused", rejection_p99=None)
    explained = " ".join(explained_comparison([unrefused, f], result.scenario).split())
    assert "- where no attempt was refused" in explained
    assert "- where no attempt was refused" not in " ".join(
        explained_comparison([f, f], result.scenario).split()
    )
    # Each ratio in the reading under it names what it is a ratio of.
    useful = dataclasses.replace(f, useful_tokens=100)
    said = " ".join(reading([useful, useful, useful], 6.0).split())
    assert "useful tokens 1.00x of those straight at the engine" in said
    assert "useful tokens 1.00x of plain openai straight at the engine" in said


# -- the counting transport -------------------------------------------------------------------


def _completion() -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    }


def _rejecting_once() -> tuple[Any, list[str]]:
    seen: list[str] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.headers.get("x-request-class", ""))
        if len(seen) == 1:
            body = {"error": {"message": "full", "type": "server_overloaded", "code": "queue_full"}}
            return httpx2.Response(429, json=body, headers={"retry-after-ms": "1", "retry-after": "1"})
        return httpx2.Response(200, json=_completion())

    return handler, seen


@pytest.mark.parametrize("kind", ["plain", "llm_backoff"])
async def test_counting_transport_sees_every_attempt_of_either_retry_loop(kind: str) -> None:
    if http_library() is not httpx2:
        pytest.skip("this openai version is not built on httpx2")
    handler, seen = _rejecting_once()
    ticks = iter(range(100))
    transport = CountingTransport(
        httpx2.MockTransport(handler), lambda: float(next(ticks)), httpx2.ByteStream
    )
    async with httpx2.AsyncClient(transport=transport) as http:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", http_client=http, max_retries=2)
        if kind == "llm_backoff":
            client = wrap(client, RetryPolicy(deadline=5.0), request_class="batch")
        record = CallRecord(0, "batch", 0.0, 5.0)

        async def call() -> None:
            bind_call(record)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])

        await asyncio.create_task(call())
        # Outside the call's task nothing is attributed to it.
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}])
    assert [a.status for a in record.attempts] == [429, 200]
    assert [a.number for a in record.attempts] == [1, 2]
    assert all(a.latency is not None and a.latency > 0 for a in record.attempts)
    assert record.attempts[0].rejected
    assert record.attempts[0].code == "queue_full"
    assert record.attempts[1].code is None
    assert not record.attempts[1].rejected
    assert len(seen) == 3
    if kind == "llm_backoff":
        assert seen[:2] == ["batch", "batch"]


def test_describe_error_is_short_and_typed() -> None:
    request = httpx2.Request("POST", "http://x/v1/chat/completions")
    body = {"message": "m", "type": "server_overloaded", "code": "queue_timeout"}
    response = httpx2.Response(429, json={"error": body}, request=request)
    exc = openai.RateLimitError("m", response=response, body=body)
    assert describe_error(exc) == "429 queue_timeout"
    assert describe_error(openai.APITimeoutError(request=request)) == "client timeout"
    assert describe_error(openai.APIConnectionError(request=request)) == "connection error"
    assert describe_error(ValueError("x")) == "ValueError"


async def test_a_call_given_up_on_its_start_deadline_says_so() -> None:
    # A hint past the caller's start deadline: llm_backoff gives up at once, and the
    # failure is told apart from one on the whole call's deadline.
    def answer(request: httpx2.Request) -> httpx2.Response:
        body = {"error": {"message": "full", "type": "server_overloaded", "code": "queue_full"}}
        return httpx2.Response(429, headers={"retry-after": "20"}, json=body)

    async with httpx2.AsyncClient(transport=httpx2.MockTransport(answer)) as http:
        raw = openai.AsyncOpenAI(base_url="http://shim.test/v1", api_key="k", http_client=http)
        for policy, expected in (
            (RetryPolicy(deadline=30, start_deadline=4), "429 queue_full (start deadline)"),
            (RetryPolicy(deadline=4), "429 queue_full"),
        ):
            with pytest.raises(openai.RateLimitError) as caught:
                await wrap(raw, policy).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}]
                )
            assert describe_error(caught.value) == expected


# -- real runs on loopback ------------------------------------------------------------------------


def _sim(**kw: Any) -> ServerThread:
    config = SimConfig(
        **{"max_num_seqs": 2, "ttft": 0.02, "itl": 0.01, "output_tokens": 5, "itl_batch_factor": 0, **kw}
    )
    return ServerThread(create_sim_app(config))


def test_direct_run_records_each_call_and_the_engine_accounting() -> None:
    scenario = Scenario("t", burst=4, rate_factor=0, duration=0, deadline=5.0, ttft_budget=5.0)
    with _sim() as sim:
        run = LoadRun(
            DIRECT_PLAIN,
            scenario,
            arrivals(scenario, 1.0, random.Random(1)),
            target_url=sim.url,
            engine_url=sim.url,
            capacity=1.0,
        )
        result = asyncio.run(run.run())
    assert [c.outcome for c in result.calls] == ["ok"] * 4
    for c in result.calls:
        assert c.tokens == 5
        assert len(c.attempts) == 1
        assert c.attempts[0].status == 200
        assert c.ttft is not None
        assert c.duration is not None
        assert 0 < c.ttft <= c.duration
    # The warm-up call happened before /sim/reset: only the run's calls are counted.
    assert result.engine_stats["requests_completed"] == 4
    assert result.engine_stats["tokens_generated"] == 20
    assert result.engine_stats["aborted_tokens"] == 0
    assert result.engine_stats["running"] == 0


def test_a_caller_past_its_deadline_leaves_and_the_engine_sees_it_go() -> None:
    scenario = Scenario("t", burst=2, rate_factor=0, duration=0, deadline=0.4, ttft_budget=0.4)
    with _sim(max_num_seqs=1, ttft=0.05, itl=0.1, output_tokens=20) as sim:
        run = LoadRun(
            DIRECT_PLAIN,
            scenario,
            arrivals(scenario, 1.0, random.Random(1)),
            target_url=sim.url,
            engine_url=sim.url,
            capacity=1.0,
        )
        result = asyncio.run(run.run())
    assert [c.outcome for c in result.calls] == ["deadline", "deadline"]
    assert all(c.error == "deadline (0.4 s)" for c in result.calls)
    stats = result.engine_stats
    assert stats["requests_aborted"] == 2
    # The running one had produced tokens for a caller that was gone: wasted work.
    assert stats["aborted_tokens"] > 0
    assert (stats["running"], stats["waiting"]) == (0, 0)
    f = figures(result)
    # One was cut mid-stream (it had tokens), the other never left the engine's queue.
    assert f.deadline_while_served == 1
    assert f.wasted_tokens == stats["aborted_tokens"]
    assert f.ok == 0
    assert f.failed_deadline == 2


def test_llm_backoff_run_through_a_real_shim_retries_rejections_to_success() -> None:
    scenario = Scenario("t", burst=3, rate_factor=0, duration=0, deadline=8.0, ttft_budget=8.0)
    with _sim(max_num_seqs=1) as sim:
        settings = ShimSettings(
            upstream=sim.url,
            max_concurrency=1,
            max_queue=0,
            retry_after_min=0.05,
            retry_after_max=1.0,
            initial_service_time=0.1,
        )
        with shim_server(create_app(settings)) as shim:
            run = LoadRun(
                SHIM_BACKOFF,
                scenario,
                arrivals(scenario, 1.0, random.Random(1)),
                target_url=shim.url,
                engine_url=sim.url,
                shim_url=shim.url,
                capacity=1.0,
            )
            result = asyncio.run(run.run())
    assert [c.outcome for c in result.calls] == ["ok"] * 3
    f = figures(result)
    assert f.rejections >= 2  # one slot, no queue: two of the three were turned away first
    assert f.attempts == 3 + f.retries
    assert f.retries >= f.rejections
    assert f.rejection_p99 is not None
    assert f.wasted_tokens == 0
    assert all(s.proxy_queued is not None for s in result.samples)


# -- child servers ------------------------------------------------------------------------------


def test_child_that_cannot_start_reports_its_output() -> None:
    child = ChildServer(
        "broken", lambda port: [sys.executable, "-c", "print('no such flag: --bogus'); raise SystemExit(2)"]
    )
    with pytest.raises(ServerStartError, match="no such flag"), child:
        pass
    assert not child.alive()


def test_child_server_is_stopped_when_the_block_ends() -> None:
    code = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    with ChildServer("tiny", lambda port: [sys.executable, "-c", code, str(port)]) as child:
        assert child.alive()
        assert child.port > 0
    assert not child.alive()
    json.dumps({"pid": child.pid})  # stop() forgot the process: nothing left to kill
    assert child.pid is None


@pytest.mark.parametrize("start_deadline", [True, False])
async def test_interactive_llm_backoff_callers_send_their_ttft_budget(start_deadline: bool) -> None:
    # The budget a caller sends is what the shim judges it on: an interactive caller that
    # states its TTFT budget sends what is left of that, a batch caller its whole deadline.
    seen: dict[str, float] = {}

    def answer(request: httpx2.Request) -> httpx2.Response:
        seen[request.headers["x-request-class"]] = float(request.headers["x-request-timeout-ms"])
        return httpx2.Response(400, json={"error": {"message": "stop here", "type": "invalid_request_error"}})

    scenario = Scenario("s", burst=1, rate_factor=0, duration=0, deadline=30.0, ttft_budget=4.0)
    async with httpx2.AsyncClient(transport=httpx2.MockTransport(answer)) as http:
        clients = build_clients(
            SHIM_BACKOFF, scenario, "http://shim.test", http, start_deadline=start_deadline
        )
        for client in clients.values():
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert 25_000 < seen["batch"] <= 30_000
    if start_deadline:
        assert 0 < seen["interactive"] <= 4_000
    else:
        assert 25_000 < seen["interactive"] <= 30_000
    assert retry_policy("interactive", scenario).start_deadline == 4.0
    assert retry_policy("batch", scenario).start_deadline is None
    assert retry_policy("interactive", scenario, start_deadline=False).start_deadline is None


def test_time_to_rejection_runs_from_the_last_byte_with_the_head_and_the_write_beside_it() -> None:
    # Head written at 0.0; the body 30 ms later (the load generator's own lag); 429 read at 32 ms.
    slow = AttemptRecord(1, 0.0, 0.032, 429, code="queue_full", written=0.0, body_sent=0.030)
    calls = [_call(0, "interactive", "error", slow, start=0.0, end=0.04, error="429 queue_full")]
    result = RunResult(
        SHIM_BACKOFF,
        Scenario("t", burst=1, rate_factor=0, duration=0, deadline=10, ttft_budget=4),
        capacity=2.0,
        calls=calls,
        samples=[],
        engine_stats={},
        elapsed=1.0,
    )
    f = figures(result)
    assert f.rejection_p99 == pytest.approx(0.002)
    assert f.rejection_from_head_p99 == pytest.approx(0.032)
    assert f.rejection_write_p99 == pytest.approx(0.030)
    assert "from the request's head" in table(f)


def test_the_heap_built_before_a_run_is_left_out_of_the_collector_s_passes_during_it() -> None:
    seen: list[int] = []

    class Probe:
        async def run(self) -> str:
            seen.append(gc.get_freeze_count())
            return "done"

    assert loadgen.run_load(Probe()) == "done"  # type: ignore[arg-type]
    assert seen[0] > 1000  # the imported modules at least
    assert gc.get_freeze_count() == 0  # collectable again after the run


def test_an_answer_that_ends_past_its_deadline_is_late_even_when_the_cut_comes_after_it() -> None:
    """The deadline's cut is a timer on the event loop; behind a busy loop an answer can end
    past the deadline before the cut is delivered. Such a call is late, not served."""
    now = [0.0]

    class BusyLoop(LoadRun):
        def clock(self) -> float:
            return now[0]

        async def _stream(self, client: Any, record: CallRecord, arrival: Any) -> None:
            record.first_token = 8.3  # the whole answer came with no await the timer could cut
            now[0] = 8.4

    scenario = Scenario("t", burst=1, rate_factor=0, duration=0, deadline=8, ttft_budget=5)
    run = BusyLoop(DIRECT_PLAIN, scenario, [], target_url="http://x", engine_url="http://x", capacity=1.0)
    record = CallRecord(0, "interactive", 0.0, 8.0)
    arrival = loadgen.Arrival(0, 0.0, "interactive")
    asyncio.run(run._call(None, record, arrival))  # type: ignore[arg-type]
    assert (record.outcome, record.error, record.end) == ("deadline", "deadline (8 s)", 8.4)
