"""End-to-end: the cost budget (``--max-inflight-tokens``) of a real shim on loopback before the
simulator. Beside a chat in flight, a burst of long prompts waits in the shim while chat is still
admitted, counting its own cost against the budget (not batch's), up to the budget; with the
request cap alone, the whole burst goes to the engine.

The simulator answers slowly (one token a second), so every request admitted stays in flight
while the test reads the shim's state; the test then hangs up. Counts only, no latency. No
answer is learned in that time, so requests are priced cold (decide/pricing.py): prompts longer
than a slot's share of the budget (3000 / 80) weigh their prompt, in the simulator's tokens as
its ``/tokenize`` counts them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from llm_backoff_shim.decide.cost import SAMPLE_TEXT
from llm_backoff_shim.decide.pricing import Pricing
from llm_backoff_shim.decide.token_budget import TokenBudget
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.protocol import estimate_tokens
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

BUDGET, SLOTS = 3000, 80
CHAT = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "w" * 400}]}
LONG = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "w" * 8000}]}
# The shim's price of each, once it has asked the simulator's /tokenize for its bytes per token.
_PRICING = Pricing(TokenBudget(BUDGET), ("interactive", "batch"), lambda: 0.0, lambda: SLOTS)
assert _PRICING.learn_ratio(SAMPLE_TEXT, estimate_tokens(SAMPLE_TEXT))
CHAT_COST = _PRICING.price_body("interactive", CHAT)
LONG_COST = _PRICING.price_body("batch", LONG)
CHATS, LONGS = 60, 4


@pytest.fixture
def slow_sim() -> Iterator[ServerThread]:
    # One token a second: nothing admitted finishes while the test looks.
    server = ServerThread(
        create_sim_app(SimConfig(ttft=0.01, itl=1.0, output_tokens=50, seed=1, max_num_seqs=64))
    ).start()
    yield server
    server.stop()


State = dict[str, Any]


async def _until(client: httpx.AsyncClient, url: str, done: Callable[[State], bool]) -> State:
    """Poll ``/shim/state`` until ``done``; the bound only stops a broken test."""
    for _ in range(2000):
        state: dict[str, Any] = (await client.get(url + "/shim/state")).json()
        if done(state):
            return state
        await asyncio.sleep(0.005)
    raise AssertionError(f"shim state never settled: {state}")


def _counts(state: dict[str, Any], cls: str) -> tuple[int, int]:
    entry = state["classes"][cls]
    return entry["in_flight"], entry["queued"]


async def _burst_then_chat(shim_url: str, sim_url: str) -> tuple[State, str, int]:
    """Send one chat (interactive), then the long prompts (batch) once it is in flight, then the
    other chats once the burst has settled; return the shim's state once every request is in
    flight or queued, its /metrics text and the requests the simulator has received, all read
    before the callers hang up (which frees slots). The first chat is there because the budget
    keeps the engine quick for the classes above batch: with none of theirs in the shim, long
    prompts would run on the request cap alone."""

    async def post(body: dict[str, Any], cls: str) -> None:
        await client.post(shim_url + "/v1/chat/completions", json=body, headers={"x-request-class": cls})

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
        # The shim asks the engine's tokenizer at start-up; priced in its tokens from then on.
        await _until(client, shim_url, lambda s: s.get("prompt_bytes_per_token", 0) != 4)
        tasks = [asyncio.create_task(post(CHAT, "interactive"))]
        await _until(client, shim_url, lambda s: _counts(s, "interactive") == (1, 0))
        tasks += [asyncio.create_task(post(LONG, "batch")) for _ in range(LONGS)]
        await _until(client, shim_url, lambda s: sum(_counts(s, "batch")) == LONGS)
        tasks += [asyncio.create_task(post(CHAT, "interactive")) for _ in range(CHATS - 1)]
        state = await _until(client, shim_url, lambda s: sum(_counts(s, "interactive")) == CHATS)
        metrics = (await client.get(shim_url + "/metrics")).text
        # What the shim admitted reaches the engine a moment later; nothing more may follow.
        in_flight = sum(_counts(state, cls)[0] for cls in ("interactive", "batch"))
        for _ in range(2000):
            received: int = (await client.get(sim_url + "/sim/stats")).json()["requests_received"]
            if received >= in_flight:
                break
            await asyncio.sleep(0.005)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return state, metrics, received


def _gauge(metrics: str, name: str) -> float:
    found = re.search(rf"^llm_backoff_shim_{name} (\S+)$", metrics, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


def test_a_burst_of_long_prompts_waits_in_the_shim_while_chat_fills_the_budget(
    slow_sim: ServerThread, make_shim: Callable[..., Any]
) -> None:
    shim = make_shim(slow_sim.url, max_concurrency=SLOTS, max_queue=40, max_inflight_tokens=BUDGET)
    state, metrics, received = asyncio.run(_burst_then_chat(shim.url, slow_sim.url))
    # One long prompt fits beside the first chat; the other three wait in the shim, whose slots
    # are mostly free.
    assert CHAT_COST + LONG_COST <= BUDGET < CHAT_COST + 2 * LONG_COST
    assert _counts(state, "batch") == (1, LONGS - 1)
    # Chat, the higher class, counts its own cost: admitted while chat's fits the budget, beside
    # the long prompt's, and no further.
    admitted = BUDGET // CHAT_COST
    assert 0 < admitted < CHATS
    assert _counts(state, "interactive") == (admitted, CHATS - admitted)
    in_flight_tokens = LONG_COST + admitted * CHAT_COST
    assert (state["in_flight_tokens"], state["max_inflight_tokens"]) == (in_flight_tokens, BUDGET)
    assert _gauge(metrics, "in_flight_tokens") == in_flight_tokens
    assert _gauge(metrics, "max_inflight_tokens") == BUDGET
    assert received == 1 + admitted  # what the engine was sent: within the budget


def test_with_the_request_cap_alone_the_whole_burst_reaches_the_engine(
    slow_sim: ServerThread, make_shim: Callable[..., Any]
) -> None:
    shim = make_shim(slow_sim.url, max_concurrency=SLOTS, max_queue=40)
    state, metrics, received = asyncio.run(_burst_then_chat(shim.url, slow_sim.url))
    assert received == LONGS + CHATS
    assert (_counts(state, "batch"), _counts(state, "interactive")) == ((LONGS, 0), (CHATS, 0))
    assert "in_flight_tokens" not in state
    assert "llm_backoff_shim_in_flight_tokens" not in metrics


async def _rounds(shim_url: str, stream: bool) -> tuple[list[int], State]:
    """Four rounds of 8 concurrent chats on the idle engine, asking ``max_tokens: 4096`` and naming
    none in turn; how many of each round got a 429, and the shim's state at the end."""
    client = openai.AsyncOpenAI(base_url=shim_url + "/v1", api_key="unused", max_retries=0)

    async def one(max_tokens: int | None) -> bool:
        extra: dict[str, Any] = {} if max_tokens is None else {"max_tokens": max_tokens}
        messages: list[Any] = [{"role": "user", "content": "Say hello to the team."}]
        try:
            if stream:
                chunks = await client.chat.completions.create(
                    model="m", messages=messages, stream=True, **extra
                )
                async for _ in chunks:
                    pass
            else:
                await client.chat.completions.create(model="m", messages=messages, **extra)
        except openai.RateLimitError:
            return False
        return True

    refused: list[int] = []
    async with httpx.AsyncClient(timeout=30) as probe:
        await _until(probe, shim_url, lambda s: s["prompt_bytes_per_token"] != 4)
        for max_tokens in (4096, None, 4096, None):
            served = await asyncio.gather(*(one(max_tokens) for _ in range(8)))
            refused.append(served.count(False))
            # The slots are given back just after the answers end: the next round finds them free.
            state = await _until(probe, shim_url, lambda s: s["in_flight_tokens"] == 0)
    await client.close()
    return refused, state


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_eight_calls_asking_for_4096_tokens_or_none_on_an_idle_engine_are_all_admitted(
    make_shim: Callable[..., Any], stream: bool
) -> None:
    # 8 sequences, answers of 20 tokens whatever max_tokens allows; a budget of 1600 (a chat-sized
    # one, as calibrate measured on such an engine, docs/calibrate.md) beside 8 slots and no queue:
    # a request that did not fit would be refused at once. Priced at max_tokens, one call of 4096
    # would fill the budget alone and the other 7 get 429s.
    sim = ServerThread(
        create_sim_app(SimConfig(ttft=0.01, itl=0.002, output_tokens=20, seed=1, max_num_seqs=8))
    ).start()
    try:
        shim = make_shim(sim.url, max_concurrency=8, max_queue=0, max_inflight_tokens=1600)
        refused, state = asyncio.run(_rounds(shim.url, stream))
    finally:
        sim.stop()
    # Cold (a slot's share each), after 8 answers (still cold), after 16 and 24 (learned: 20).
    assert refused == [0, 0, 0, 0]
    assert state["answer_tokens"]["interactive"] == 20


async def _close_after(shim_url: str, chunks: int, calls: int) -> State:
    """``calls`` concurrent streams, each closed by its client after ``chunks`` chunks; the shim's
    state once every slot is back."""
    client = openai.AsyncOpenAI(base_url=shim_url + "/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Say hello to the team."}]

    async def one() -> int:
        stream = await client.chat.completions.create(
            model="m", messages=messages, stream=True, max_tokens=4096
        )
        seen = 0
        async with stream:
            async for _ in stream:
                seen += 1
                if seen == chunks:
                    break
        return seen

    async with httpx.AsyncClient(timeout=30) as probe:
        await _until(probe, shim_url, lambda s: s["prompt_bytes_per_token"] != 4)
        assert await asyncio.gather(*(one() for _ in range(calls))) == [chunks] * calls
        state = await _until(probe, shim_url, lambda s: s["in_flight_tokens"] == 0)
    await client.close()
    return state


def test_streams_their_clients_close_teach_the_answer_length(make_shim: Callable[..., Any]) -> None:
    # Answers of 400 tokens at 20 a second: every client closes its stream after 6 chunks, long
    # before the engine would end it. The engine held each slot for those tokens only, and a
    # client that stops reading (a client-side stop, a caller that has what it wanted) is how
    # many answers end: the shim learns the length they had, not nothing (Outcome.ENDED_BY_CLIENT).
    sim = ServerThread(
        create_sim_app(SimConfig(ttft=0.01, itl=0.05, output_tokens=400, seed=1, max_num_seqs=16))
    ).start()
    try:
        shim = make_shim(sim.url, max_concurrency=16, max_queue=0, max_inflight_tokens=100_000)
        state = asyncio.run(_close_after(shim.url, chunks=6, calls=16))
    finally:
        sim.stop()
    learned = state["answer_tokens"]["interactive"]
    # At least what each client read (its role chunk and 5 tokens); whatever the relay had sent on
    # before the close was seen, far short of the 400 the engine would have made.
    assert learned is not None
    assert 5 <= learned < 400
