"""End-to-end tests against a real vLLM (opt-in: marker ``vllm``).

They run only when ``LLM_BACKOFF_TEST_VLLM_URL`` points at a running vLLM started as
docs/real-vllm.md says (``bench/real_vllm/setup.sh`` builds one), with these flags the
tests rely on::

    --max-num-seqs 8 --max-num-queued-reqs 12 --scheduling-policy priority

Run them with ``LLM_BACKOFF_TEST_VLLM_URL=http://127.0.0.1:PORT pytest -m vllm
server_shim/tests/test_vllm.py``. Each test starts its own shim in a thread on loopback
in front of that vLLM (conftest's ``make_shim``) and reads vLLM's own ``/metrics``
(``vllm:num_requests_running`` / ``vllm:num_requests_waiting``,
``vllm:request_success_total{finished_reason="abort"}``) to see what the engine did.
Long answers are forced with ``ignore_eos`` so a request holds its engine slot until the
test lets it go; every wait is bounded (a broken set-up fails, it never hangs) and no
assertion is on a duration.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llm_backoff import wrap
from llm_backoff_shim.lab import calibrate
from llm_backoff_shim.lab.loadgen_engine import GENERATED, RUNNING, WAITING, metric_sum
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.tuning import Tuning

VLLM_URL = os.environ.get("LLM_BACKOFF_TEST_VLLM_URL", "").rstrip("/")
SLOTS = 8  # --max-num-seqs
IN_FLIGHT_LIMIT = 12  # --max-num-queued-reqs: running + waiting
#: Long enough to hold a slot for the whole of a test step (the model's context is 2048).
HOLD_TOKENS = 1800
WAIT = 60.0  # bound on any one wait: only a broken set-up reaches it

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_URL, reason="LLM_BACKOFF_TEST_VLLM_URL is not set (docs/real-vllm.md)"),
]


@pytest.fixture(scope="module")
def model() -> str:
    response = httpx.get(VLLM_URL + "/v1/models", timeout=10)
    response.raise_for_status()
    name: str = response.json()["data"][0]["id"]
    return name


async def engine_counts(client: httpx.AsyncClient) -> tuple[int, int, int]:
    """vLLM's (running, waiting, answer tokens generated so far) from its /metrics.

    Client aborts are not counted in ``vllm:request_success_total``; the generation counter
    shows that an abandoned request stopped short of its ``max_tokens``.
    """
    text = (await client.get(VLLM_URL + "/metrics")).text
    return (
        int(metric_sum(text, RUNNING) or 0),
        int(metric_sum(text, WAITING) or 0),
        int(metric_sum(text, GENERATED) or 0),
    )


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = WAIT) -> None:
    """Poll ``check``; the timeout only bounds a broken set-up, it asserts no latency."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await check():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def engine_idle(client: httpx.AsyncClient) -> None:
    async def idle() -> bool:
        running, waiting, _ = await engine_counts(client)
        return running == 0 and waiting == 0

    await until(idle, "vLLM to be idle before the test")


_order = itertools.count()


@dataclass
class Stream:
    """One streaming chat completion run as a task; cancelling the task disconnects it."""

    status: int | None = None
    first_token: int | None = None  # position among all first tokens of the test (ordering)
    chunks: int = 0
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    headers: httpx.Headers | None = None
    finished: bool = False
    task: asyncio.Task[None] | None = None

    async def cancel(self) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def chat_body(model: str, max_tokens: int, prompt: str = "tell me about the water") -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def start_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Stream:
    stream = Stream()

    async def run() -> None:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers or {}
        ) as response:
            stream.status = response.status_code
            stream.headers = response.headers
            if response.status_code != 200:
                stream.error = json.loads(await response.aread())
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    stream.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        stream.chunks += 1
                        if stream.first_token is None:
                            stream.first_token = next(_order)
        stream.finished = True

    stream.task = asyncio.get_running_loop().create_task(run())
    return stream


def slots_back(shim: Any, waiter: Callable[..., None]) -> None:
    """Every slot and queue place of the shim comes back (it sees each disconnect on its own)."""
    waiter(
        lambda: all(counts == (0, 0) for counts in shim.state().values()),
        timeout=WAIT,
        what="the shim's slots and queues to be back to zero",
    )


def shim_metric(shim: Any, name: str) -> float | None:
    for (sample, _labels), value in shim.metrics().items():
        if sample == name:
            return float(value)
    return None


def test_streaming_with_usage_through_the_shim(
    make_shim: Callable[..., Any], model: str, waiter: Callable[..., None]
) -> None:
    shim = make_shim(VLLM_URL, max_concurrency=8, max_queue=8)
    plain = openai.OpenAI(base_url=shim.url + "/v1", api_key="EMPTY", max_retries=0)
    wrapped = wrap(openai.OpenAI(base_url=shim.url + "/v1", api_key="EMPTY"), request_class="interactive")
    for client in (plain, wrapped):
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": "name a river"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        assert "x-queue-time-ms" in raw.headers
        content, usage = [], None
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                content.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert content, "no content streamed"
        assert usage is not None
        assert usage.completion_tokens == 12
        assert usage.prompt_tokens > 0
    slots_back(shim, waiter)


def test_abort_on_disconnect_reaches_vllm(
    make_shim: Callable[..., Any], model: str, waiter: Callable[..., None]
) -> None:
    shim = make_shim(VLLM_URL, max_concurrency=4, max_queue=4)

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=WAIT) as client:
            await engine_idle(client)
            _, _, generated_before = await engine_counts(client)
            stream = start_stream(client, shim.url, chat_body(model, HOLD_TOKENS))
            await until(lambda: _true(stream.chunks > 0), "the first tokens through the shim")

            async def running_one() -> bool:
                return (await engine_counts(client))[0] == 1

            await until(running_one, "vLLM running the request")
            await stream.cancel()

            async def stopped() -> bool:
                return (await engine_counts(client))[0] == 0

            await until(stopped, "vLLM to drop the request after the client left")
            assert not stream.finished
            _, _, generated_after = await engine_counts(client)
            assert generated_after - generated_before < HOLD_TOKENS, "vLLM generated the whole answer"

    asyncio.run(scenario())
    slots_back(shim, waiter)


async def _true(value: bool) -> bool:
    return value


def test_engine_aware_admission_holds_requests_while_vllm_queues(
    make_shim: Callable[..., Any], model: str, waiter: Callable[..., None]
) -> None:
    # Well above vLLM's 8 slots: only the engine's own metrics can make the shim hold work.
    shim = make_shim(
        VLLM_URL,
        max_concurrency=32,
        max_queue=32,
        max_queue_wait=WAIT,
        engine_metrics=True,
        tuning=Tuning(engine_poll_interval=0.1, engine_max_waiting=0),
    )

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=WAIT) as client:
            await engine_idle(client)
            # Straight at vLLM: every slot busy and one request in its waiting queue.
            holders = [
                start_stream(client, VLLM_URL, chat_body(model, HOLD_TOKENS)) for _ in range(SLOTS + 1)
            ]

            async def full() -> bool:
                running, waiting, _ = await engine_counts(client)
                return running == SLOTS and waiting == 1

            await until(full, "vLLM full with one waiting")

            async def shim_sees_saturation() -> bool:
                return shim_metric(shim, "llm_backoff_shim_engine_saturated") == 1.0

            await until(shim_sees_saturation, "the shim to read vLLM's waiting queue as saturation")
            through = [start_stream(client, shim.url, chat_body(model, 8)) for _ in range(4)]

            async def held() -> bool:
                return bool(shim.state()["interactive"] == (0, 4))

            await until(held, "the shim to hold the four requests in its own queue")
            running, waiting, _ = await engine_counts(client)
            assert (running, waiting) == (SLOTS, 1), "the shim sent work to a saturated vLLM"
            for holder in holders:
                await holder.cancel()

            async def served() -> bool:
                return all(s.finished for s in through)

            await until(served, "the held requests to be admitted and served once vLLM drained")
            assert all(s.status == 200 and s.usage and s.usage["completion_tokens"] == 8 for s in through)

    asyncio.run(scenario())
    slots_back(shim, waiter)


def test_engine_aware_admission_keeps_vllm_waiting_within_bound_in_a_burst(
    make_shim: Callable[..., Any], model: str, waiter: Callable[..., None]
) -> None:
    """A burst arriving between two scrapes: the shim counts what it admitted since the last
    scrape, so vLLM's waiting queue stays within ``Tuning.engine_max_waiting``.

    The engine's slots are not in vLLM's metrics; the shim may learn them from a scrape
    that shows the engine full (requests waiting), so the engine is shown full to it once
    before the burst."""
    max_waiting = 2
    shim = make_shim(
        VLLM_URL,
        max_concurrency=32,
        max_queue=32,
        max_queue_wait=WAIT,
        engine_metrics=True,
        tuning=Tuning(engine_poll_interval=0.25, engine_max_waiting=max_waiting),
    )
    burst = SLOTS + max_waiting + 2  # within vLLM's own in-flight limit, so it never answers 503

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=WAIT) as client:
            await engine_idle(client)
            holders = [
                start_stream(client, VLLM_URL, chat_body(model, HOLD_TOKENS)) for _ in range(SLOTS + 1)
            ]

            async def seen_full() -> bool:
                return shim_metric(shim, "llm_backoff_shim_engine_waiting") == 1.0

            await until(seen_full, "the shim to scrape vLLM full with one waiting")
            for holder in holders:
                await holder.cancel()

            async def seen_idle() -> bool:
                return shim_metric(shim, "llm_backoff_shim_engine_running") == 0.0

            await until(seen_idle, "the shim to scrape vLLM idle again")
            streams = [start_stream(client, shim.url, chat_body(model, 300)) for _ in range(burst)]
            peak = 0
            while not all(s.finished or s.error for s in streams):
                peak = max(peak, (await engine_counts(client))[1])
                await asyncio.sleep(0.02)
            assert all(s.status == 200 and s.finished for s in streams)
            assert peak <= max_waiting, f"vLLM's waiting queue reached {peak} (bound {max_waiting})"

    asyncio.run(scenario())
    slots_back(shim, waiter)


def test_forwarded_priority_lets_interactive_overtake_batch_in_vllm(
    make_shim: Callable[..., Any], model: str, waiter: Callable[..., None]
) -> None:
    shim = make_shim(VLLM_URL, max_concurrency=32, max_queue=32, forward_priority=True)
    settings = ShimSettings.model_validate({"upstream": VLLM_URL, "forward_priority": True})
    assert settings.vllm_priority() == {
        "interactive": 0,
        "batch": 1,
    }

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=WAIT) as client:
            await engine_idle(client)
            batch = {"x-request-class": "batch"}
            running = [
                start_stream(client, shim.url, chat_body(model, HOLD_TOKENS), batch) for _ in range(SLOTS)
            ]
            await until(lambda: _true(all(s.chunks > 0 for s in running)), "eight batch requests running")
            queued = [start_stream(client, shim.url, chat_body(model, 16), batch) for _ in range(3)]

            async def waiting(n: int) -> bool:
                return (await engine_counts(client))[1] == n

            await until(lambda: waiting(3), "three batch requests waiting in vLLM")
            urgent = start_stream(client, shim.url, chat_body(model, 16), {"x-request-class": "interactive"})
            await until(lambda: waiting(4), "the interactive request waiting in vLLM behind them")
            await running[0].cancel()  # one slot frees: vLLM picks the lowest priority value
            await until(lambda: _true(urgent.finished), "the interactive request to be served")
            assert urgent.first_token is not None
            # Once it is done its slot goes to a batch request: compare the order of first tokens.
            assert all(s.first_token is None or s.first_token > urgent.first_token for s in queued), (
                "a batch request queued earlier started first: is vLLM running with "
                "--scheduling-policy priority?"
            )
            for s in running + queued:
                await s.cancel()

    asyncio.run(scenario())
    slots_back(shim, waiter)


def test_vllm_503_is_relayed_as_a_retryable_rejection(
    make_shim: Callable[..., Any], model: str, waiter: Callable[..., None]
) -> None:
    # The shim admits more than vLLM accepts: vLLM's own --max-num-queued-reqs answers 503.
    shim = make_shim(VLLM_URL, max_concurrency=32, max_queue=0)
    extra = 3

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=WAIT) as client:
            await engine_idle(client)
            accepted = [
                start_stream(client, shim.url, chat_body(model, HOLD_TOKENS)) for _ in range(IN_FLIGHT_LIMIT)
            ]

            async def in_vllm() -> bool:
                running, waiting, _ = await engine_counts(client)
                return running + waiting == IN_FLIGHT_LIMIT

            await until(in_vllm, "vLLM holding its limit of requests")
            refused = [start_stream(client, shim.url, chat_body(model, 8)) for _ in range(extra)]
            await until(
                lambda: _true(all(s.status is not None for s in refused)), "answers to the extra requests"
            )
            for s in refused:
                assert s.status == 429, (
                    f"expected the shim's 429, got {s.status} (vLLM without --max-num-queued-reqs?)"
                )
                assert s.headers is not None
                assert int(s.headers["retry-after"]) >= 1
                assert "retry-after-ms" in s.headers
                assert s.error is not None
                error = s.error["error"]
                assert error["code"] == "queue_full"
                assert error["type"] == "server_overloaded"
                assert "upstream answered 503" in error["message"]
                assert error["retry_after_seconds"] > 0
            for s in accepted:
                await s.cancel()

    asyncio.run(scenario())
    slots_back(shim, waiter)


def test_calibrate_finds_a_knee_above_one(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = [
        "--upstream",
        VLLM_URL,
        "--steps",
        "1,2,4,8",
        "--step-seconds",
        "3",
        "--prompt-tokens",
        "20-100",
        "--output-tokens",
        "32-96",
        "--ttft-slo",
        "2",
        "--max-seconds",
        "90",
        "--out",
        str(tmp_path),
        "--json",
    ]
    status = calibrate.main(argv, stdout=out, stderr=err)
    assert status == 0, err.getvalue()
    result = json.loads(out.getvalue())
    recommendation = result["recommendation"]
    assert recommendation["max_concurrency"] > 1, result["reason"]
    knee = next(s for s in result["steps"] if s["concurrency"] == result["knee"]["concurrency"])
    assert knee["output_tokens_per_s"] > 0
    assert knee["mean_output_tokens"] > 0
    flags = recommendation["command"].split()
    assert "--max-concurrency" in flags


async def test_anthropic_messages_through_the_shim_and_its_refusals(
    make_shim: Callable[..., Any], model: str, waiter: Callable[..., None]
) -> None:
    """vLLM's Anthropic-compatible /v1/messages through the shim, with the real anthropic SDK.

    With the shim's only slot held by a long generation on vLLM, a call with the SDK's
    retries off gets the shim's 529 ``overloaded_error`` with the hint; a call through
    ``llm_backoff.wrap`` rides it out once the slot frees, and vLLM answers it.
    """
    anthropic = pytest.importorskip("anthropic")
    shim = make_shim(VLLM_URL, max_concurrency=1, max_queue=0, retry_after_min=0.05, retry_after_max=0.2)
    hello = [{"role": "user", "content": "name a river"}]
    plain = anthropic.AsyncAnthropic(base_url=shim.url, api_key="EMPTY", max_retries=0)
    message = await plain.messages.create(model=model, max_tokens=8, messages=hello)
    assert message.type == "message"
    assert message.usage.output_tokens > 0
    async with httpx.AsyncClient(timeout=WAIT) as client:
        await engine_idle(client)
        holder = start_stream(client, shim.url, chat_body(model, HOLD_TOKENS))
        await until(lambda: asyncio.sleep(0, holder.chunks > 0), "the holder to generate")
        with pytest.raises(anthropic.OverloadedError) as caught:
            await plain.messages.create(model=model, max_tokens=8, messages=hello)
        assert caught.value.status_code == 529
        assert caught.value.response.headers["retry-after-ms"]
        assert caught.value.body["error"]["type"] == "overloaded_error"
        wrapped = wrap(anthropic.AsyncAnthropic(base_url=shim.url, api_key="EMPTY"), request_class="batch")
        call = asyncio.ensure_future(wrapped.messages.create(model=model, max_tokens=8, messages=hello))
        await until(lambda: asyncio.sleep(0, (shim_metric_total(shim, "rejected") or 0) >= 2), "a retry")
        await holder.cancel()
        answer = await asyncio.wait_for(call, WAIT)
        assert answer.usage.output_tokens > 0
    await plain.close()
    await wrapped.close()
    await asyncio.to_thread(slots_back, shim, waiter)


def shim_metric_total(shim: Any, outcome: str) -> float | None:
    """``llm_backoff_shim_requests_total`` summed over the labels with this outcome."""
    total = None
    for (sample, labels), value in shim.metrics().items():
        if sample == "llm_backoff_shim_requests_total" and dict(labels).get("outcome") == outcome:
            total = (total or 0.0) + float(value)
    return total
