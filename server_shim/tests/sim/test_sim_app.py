"""The simulator end to end: uvicorn on loopback, driven by the openai SDK, httpx and aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.runtime import SimRuntime
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


class Sim:
    def __init__(self, srv: ServerThread, runtime: SimRuntime) -> None:
        self.srv = srv
        self.runtime = runtime
        self.url = srv.url

    def idle(self) -> bool:
        engine = self.runtime.engine
        return self.runtime.open_tickets == engine.num_running == engine.num_waiting == 0

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = httpx.get(self.url + "/sim/stats").json()
        return result

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        raise KeyError(name)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", api_key="test", **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="test", **kwargs)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


async def async_wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


@pytest.fixture
def start_sim() -> Iterator[Callable[..., Sim]]:
    servers: list[Sim] = []

    def start(**config: Any) -> Sim:
        app = create_sim_app(SimConfig(**config))
        srv = ServerThread(app).start()
        sim = Sim(srv, app.state.sim)
        servers.append(sim)
        return sim

    yield start
    for sim in servers:
        # Nothing leaks: every ticket released and every slot freed once clients are gone.
        wait_until(sim.idle)
        sim.srv.stop()


FAST = {"ttft": 0.01, "itl": 0.005}


def test_non_streamed_chat_and_completion_look_like_vllm(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim(output_tokens=5, **FAST)
    client = sim.client()

    chat = client.chat.completions.create(model="any-name", messages=MSG)
    assert chat.id.startswith("chatcmpl-")
    assert chat.object == "chat.completion"
    assert chat.model == "any-name"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == "token0 token1 token2 token3 token4"
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5

    completion = client.completions.create(model="m", prompt="Say something", max_tokens=3)
    assert completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    assert completion.choices[0].text == "token0 token1 token2"
    assert completion.choices[0].finish_reason == "length"

    stats = sim.stats()
    assert stats["requests_received"] == stats["requests_completed"] == 2
    assert stats["tokens_generated"] == 8
    assert sim.metric("vllm:e2e_request_latency_seconds_count") == 2
    assert sim.metric("vllm:time_to_first_token_seconds_count") == 2
    assert sim.metric("vllm:request_queue_time_seconds_count") == 2
    assert sim.metric("vllm:generation_tokens_total") == 8


def test_stream_arrives_token_by_token_with_usage_and_done(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim(output_tokens=20, ttft=0.01, itl=0.05)
    body = {
        "model": "m",
        "messages": MSG,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[Any] = []
    running_at_first_token: int | None = None
    with httpx.stream("POST", sim.url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                continue
            payload = line.removeprefix("data: ")
            event = payload if payload == "[DONE]" else json.loads(payload)
            events.append(event)
            is_token = (
                isinstance(event, dict) and event["choices"] and event["choices"][0]["delta"].get("content")
            )
            if running_at_first_token is None and is_token:
                # The answer is still being generated while its first token is in our hands.
                stats = sim.stats()
                running_at_first_token = stats["running"]
                assert stats["tokens_generated"] < 20
    assert running_at_first_token == 1
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 20
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == " ".join(f"token{i}" for i in range(20))


def test_openai_sdk_streams_chat_and_completions(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim(output_tokens=6, **FAST)
    client = sim.client()
    stream = client.chat.completions.create(
        model="m",
        messages=MSG,
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=4,
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == "token0 token1 token2 token3"
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    texts = [c.choices[0].text for c in client.completions.create(model="m", prompt="x", stream=True)]
    assert "".join(texts) == "token0 token1 token2 token3 token4 token5"


async def test_concurrency_cap_holds_and_the_rest_wait_fifo(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim(max_num_seqs=3, output_tokens=10, ttft=0.03, itl=0.03)
    client = sim.async_client()
    running_seen: list[float] = []
    waiting_seen: list[float] = []

    async def one() -> str:
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def watch(done: asyncio.Event) -> None:
        async with httpx.AsyncClient() as http:
            while not done.is_set():
                text = (await http.get(sim.url + "/metrics")).text
                for family in text_string_to_metric_families(text):
                    if family.name == "vllm:num_requests_running":
                        running_seen.append(family.samples[0].value)
                    elif family.name == "vllm:num_requests_waiting":
                        waiting_seen.append(family.samples[0].value)
                await asyncio.sleep(0.01)

    done = asyncio.Event()
    watcher = asyncio.create_task(watch(done))
    texts = await asyncio.gather(*(one() for _ in range(10)))
    done.set()
    await watcher
    await client.close()

    assert texts == [" ".join(f"token{i}" for i in range(10))] * 10
    assert running_seen
    assert max(running_seen) <= 3
    stats = sim.stats()
    assert stats["peak_running"] == 3
    assert stats["peak_waiting"] >= 1
    assert stats["requests_completed"] == 10
    assert max(waiting_seen) <= 7


def test_max_num_queued_reqs_answers_vllm_503_without_retry_after(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim(max_num_seqs=1, max_num_queued_reqs=2, output_tokens=200, ttft=0.01, itl=0.05)
    body = {"model": "m", "messages": MSG, "stream": True}
    with httpx.Client(timeout=30) as http, contextlib.ExitStack() as held:
        for _ in range(2):
            response = held.enter_context(http.stream("POST", sim.url + "/v1/chat/completions", json=body))
            assert response.status_code == 200
        wait_until(lambda: sim.stats()["running"] == 1 and sim.stats()["waiting"] == 1)

        with pytest.raises(openai.InternalServerError) as info:
            sim.client().chat.completions.create(model="m", messages=MSG)
        assert info.value.status_code == 503
        assert info.value.body == {
            "message": "Request queue full.",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
        assert "retry-after" not in info.value.response.headers
        assert "retry-after-ms" not in info.value.response.headers
    # Both held streams went away: their slots are free and a new request is served.
    wait_until(lambda: sim.stats()["running"] == 0)
    answer = sim.client().chat.completions.create(model="m", messages=MSG, max_tokens=2)
    assert answer.choices[0].message.content == "token0 token1"
    stats = sim.stats()
    assert stats["requests_rejected"] == 1
    assert stats["requests_aborted"] == 2
    assert sim.metric("sim_requests_rejected_total") == 1


async def test_disconnect_while_queued_or_running_non_streamed_frees_the_slot(
    start_sim: Callable[..., Sim],
) -> None:
    sim = start_sim(max_num_seqs=1, output_tokens=400, ttft=0.01, itl=0.02)
    engine = sim.runtime.engine
    body = {"model": "m", "messages": MSG}
    async with httpx.AsyncClient(timeout=30) as http:
        running = asyncio.create_task(http.post(sim.url + "/v1/chat/completions", json=body))
        await async_wait_until(lambda: engine.num_running == 1 and engine.stats.tokens_generated >= 2)
        queued = asyncio.create_task(http.post(sim.url + "/v1/chat/completions", json=body))
        await async_wait_until(lambda: engine.num_waiting == 1)

        queued.cancel()
        await async_wait_until(lambda: engine.num_waiting == 0)
        assert engine.stats.requests_aborted == 1
        assert engine.stats.aborted_tokens == 0
        assert engine.num_running == 1

        running.cancel()
        await async_wait_until(lambda: engine.num_running == 0)
    stats = sim.stats()
    assert stats["requests_aborted"] == 2
    assert 2 <= stats["aborted_tokens"] < 400
    assert stats["aborted_tokens"] == stats["tokens_generated"]
    assert stats["requests_completed"] == 0


async def test_disconnect_mid_stream_with_aiohttp_aborts_and_admits_the_next(
    start_sim: Callable[..., Sim],
) -> None:
    sim = start_sim(max_num_seqs=1, output_tokens=400, ttft=0.01, itl=0.02)
    engine = sim.runtime.engine
    body = {"model": "m", "messages": MSG, "stream": True}
    async with aiohttp.ClientSession() as session:
        first = await session.post(sim.url + "/v1/chat/completions", json=body)
        second = await session.post(sim.url + "/v1/chat/completions", json=body)
        lines = 0
        async for line in first.content:
            lines += line.startswith(b"data: ")
            if lines == 3:
                break
        first.close()  # drop the connection mid-stream
        await async_wait_until(lambda: engine.stats.requests_aborted == 1)
        assert 2 <= engine.stats.aborted_tokens < 400
        # The waiter took the freed slot at once.
        assert engine.num_running == 1
        assert engine.num_waiting == 0
        async for line in second.content:
            if line.startswith(b"data: {"):
                assert json.loads(line[6:])["choices"][0]["delta"]["role"] == "assistant"
                break
        second.close()
    await async_wait_until(lambda: engine.num_running == 0)
    assert sim.stats()["requests_aborted"] == 2


def test_malformed_requests_get_openai_format_400s(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim(**FAST)
    response = httpx.post(
        sim.url + "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert "Invalid JSON" in error["message"]

    with pytest.raises(openai.BadRequestError) as info:
        sim.client().chat.completions.create(model="m", messages=[])
    assert info.value.body is not None
    assert info.value.body["param"] == "messages"  # type: ignore[index]

    with pytest.raises(openai.BadRequestError):
        sim.client().completions.create(model="m", prompt=["a", "b"])

    response = httpx.get(sim.url + "/v1/completions")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == 405

    response = httpx.post(sim.url + "/v1/completions", content=b"x" * (8 * 1024 * 1024 + 1))
    assert response.status_code == 413
    assert sim.stats()["requests_invalid"] == 4
    assert sim.stats()["requests_received"] == 0


def test_models_health_and_counter_reset(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim(model="my-model", output_tokens=2, **FAST)
    client = sim.client()
    assert [m.id for m in client.models.list()] == ["my-model"]
    health = httpx.get(sim.url + "/health")
    assert health.status_code == 200
    assert health.content == b""

    answer = client.chat.completions.create(model="my-model", messages=MSG)
    assert answer.model == "my-model"
    assert sim.stats()["requests_completed"] == 1
    assert sim.metric("vllm:num_requests_running", model_name="my-model", engine="0") == 0

    reset = httpx.post(sim.url + "/sim/reset")
    assert reset.status_code == 200
    assert reset.json()["requests_completed"] == 0
    assert sim.stats()["tokens_generated"] == 0
    assert sim.metric("sim_requests_completed_total") == 0


def test_injected_500_and_connection_reset(start_sim: Callable[..., Sim]) -> None:
    errors = start_sim(error_rate=1.0, **FAST)
    with pytest.raises(openai.InternalServerError) as info:
        errors.client().chat.completions.create(model="m", messages=MSG)
    assert info.value.status_code == 500
    assert errors.stats()["injected_errors"] == 1

    resets = start_sim(reset_rate=1.0, **FAST)
    with pytest.raises(openai.APIConnectionError):
        resets.client().chat.completions.create(model="m", messages=MSG)
    with pytest.raises(httpx.TransportError):
        httpx.post(resets.url + "/v1/completions", json={"prompt": "x"})
    assert resets.stats()["injected_resets"] == 2
    assert resets.metric("sim_injected_faults_total", kind="reset") == 2


def test_stream_cut_mid_way(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim(stream_cut_rate=1.0, output_tokens=30, seed=5, **FAST)
    received: list[str] = []
    stream = sim.client().chat.completions.create(model="m", messages=MSG, stream=True)
    with pytest.raises(openai.APIConnectionError):
        received.extend(chunk.choices[0].delta.content or "" for chunk in stream)
    assert 1 <= len([t for t in received if t]) < 30
    stats = sim.stats()
    assert stats["injected_stream_cuts"] == 1
    assert stats["requests_completed"] == 0
    assert stats["requests_aborted"] == 0  # a cut is the server's doing, not wasted client work


def test_slow_first_byte_trips_a_client_read_timeout(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim(slow_first_byte_rate=1.0, slow_first_byte_delay=30.0, **FAST)
    with pytest.raises(openai.APITimeoutError):
        sim.client(timeout=0.3).chat.completions.create(model="m", messages=MSG)
    wait_until(lambda: sim.stats()["requests_aborted"] == 1)
    stats = sim.stats()
    assert stats["injected_slow_first_byte"] == 1
    assert stats["tokens_generated"] == 0


# -- the work follows each request ----------------------------------------------------------


def test_ignore_eos_gives_exactly_max_tokens_and_without_it_the_natural_length_is_capped(
    start_sim: Callable[..., Sim],
) -> None:
    sim = start_sim(output_tokens=30, output_tokens_sigma=0.8, seed=3, **FAST)
    client = sim.client()
    exact = [
        client.chat.completions.create(model="m", messages=MSG, max_tokens=n, extra_body={"ignore_eos": True})
        for n in (1, 7, 80)
    ]
    assert [c.usage.completion_tokens for c in exact if c.usage] == [1, 7, 80]
    assert {c.choices[0].finish_reason for c in exact} == {"length"}

    natural = [client.chat.completions.create(model="m", messages=MSG) for _ in range(12)]
    lengths = [c.usage.completion_tokens for c in natural if c.usage]
    assert len(set(lengths)) > 3  # drawn per request
    assert {c.choices[0].finish_reason for c in natural} == {"stop"}
    capped = [client.chat.completions.create(model="m", messages=MSG, max_tokens=20) for _ in range(12)]
    capped_lengths = [c.usage.completion_tokens for c in capped if c.usage]
    assert max(capped_lengths) <= 20
    assert any(c.choices[0].finish_reason == "length" for c in capped)

    bad = httpx.post(sim.url + "/v1/chat/completions", json={"messages": MSG, "ignore_eos": "yes"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "ignore_eos"


def test_usage_counts_the_prompt_and_a_longer_prompt_takes_longer_to_start(
    start_sim: Callable[..., Sim],
) -> None:
    # Prefill at 2 ms per token: 1000 words (1300 tokens) is 2.6 s against a few ms.
    sim = start_sim(output_tokens=1, ttft=0.0, itl=0.001, prefill_time_per_token=0.002)
    client = sim.client()
    short = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "one two"}])
    long = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 1000}])
    assert short.usage is not None
    assert long.usage is not None
    assert short.usage.prompt_tokens == 3 + 4  # ceil(1.3 * 2) + the template's 4
    assert long.usage.prompt_tokens == 1300 + 4
    ttft = sim.runtime.metrics.registry.get_sample_value(
        "vllm:time_to_first_token_seconds_bucket", {"model_name": "sim-model", "engine": "0", "le": "1.0"}
    )
    assert ttft == 1  # the short one within 1 s, the long one not (2.6 s of prefill)
    assert sim.stats()["prefill_tokens"] == 7 + 1304


def test_a_kv_cache_too_small_preempts_and_a_request_too_long_gets_vllms_400(
    start_sim: Callable[..., Sim],
) -> None:
    sim = start_sim(max_num_seqs=4, output_tokens=1, ttft=0.0, itl=0.002, kv_cache_tokens=400)
    client = sim.client()
    with pytest.raises(openai.BadRequestError, match="maximum context length is 400 tokens"):
        client.chat.completions.create(model="m", messages=MSG, max_tokens=500)

    async def four() -> list[int]:
        aclient = sim.async_client()
        answers = await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model="m", messages=MSG, max_tokens=150, extra_body={"ignore_eos": True}
                )
                for _ in range(4)
            ]
        )
        return [a.usage.completion_tokens if a.usage else 0 for a in answers]

    assert asyncio.run(four()) == [150] * 4
    assert sim.stats()["preemptions"] >= 1
    assert sim.metric("vllm:num_preemptions_total") == sim.stats()["preemptions"]
