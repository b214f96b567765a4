"""The shim learns the engine's bytes per token from its /tokenize once (serve/policy/prompt_units.py),
and keeps 4 bytes a token when the engine has no such endpoint."""

from __future__ import annotations

import asyncio

import aiohttp
from starlette.applications import Starlette

from llm_backoff_shim.decide.cost import BYTES_PER_TOKEN, SAMPLE_TEXT
from llm_backoff_shim.decide.pricing import Pricing
from llm_backoff_shim.decide.token_budget import TokenBudget
from llm_backoff_shim.serve.policy.prompt_units import ask_tokenizer
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.protocol import estimate_tokens
from llm_backoff_shim.sim.server import SimConfig, create_sim_app


def pricing() -> Pricing:
    return Pricing(TokenBudget(1000), ("interactive",), lambda: 0.0, lambda: 4)


async def ask(url: str, price: Pricing) -> bool | None:
    async with aiohttp.ClientSession() as session:
        return await ask_tokenizer(session, url + "/tokenize", price)


def test_the_ratio_is_the_engines_count_of_the_sample() -> None:
    server = ServerThread(create_sim_app(SimConfig(seed=1))).start()
    try:
        price = pricing()
        assert asyncio.run(ask(server.url, price)) is True
    finally:
        server.stop()
    assert price.ratio == len(SAMPLE_TEXT.encode()) / estimate_tokens(SAMPLE_TEXT)


def test_an_engine_without_a_tokenizer_leaves_four_bytes_a_token_and_is_not_asked_again() -> None:
    server = ServerThread(Starlette()).start()  # every path a 404
    try:
        price = pricing()
        assert asyncio.run(ask(server.url, price)) is False
    finally:
        server.stop()
    assert price.ratio == BYTES_PER_TOKEN


def test_an_engine_not_yet_up_is_asked_again_later() -> None:
    price = pricing()
    assert asyncio.run(ask("http://127.0.0.1:9", price)) is None
    assert price.ratio == BYTES_PER_TOKEN
