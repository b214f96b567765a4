"""Credentials and request hooks are redone per attempt, as openai's own retries redo them.

A real server on 127.0.0.1 answers 429 twice and then 200, and records what each
attempt carried: the ``Authorization`` / ``api-key`` header and a header set by an
httpx request event hook. Waits are skipped with ``instant_retries``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import llm_backoff
from llm_backoff.testing import instant_retries

MESSAGES: Any = [{"role": "user", "content": "hi"}]
COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
}


class Counting:
    """429 (``retry-after-ms: 5``) for the first ``busy`` requests, then a completion.

    Keeps the headers of each request.
    """

    def __init__(self, busy: int = 2) -> None:
        self.busy = busy
        self.seen: list[dict[str, str]] = []
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def answer(request: Request) -> Response:
            with self.lock:
                self.seen.append(dict(request.headers))
                n = len(self.seen)
            if n <= self.busy:
                return JSONResponse(
                    {"error": {"message": "busy", "type": "server_overloaded"}},
                    status_code=429,
                    headers={"retry-after-ms": "5"},
                )
            return JSONResponse(COMPLETION)

        return Starlette(routes=[Route("/{path:path}", answer, methods=["POST"])])

    def header(self, name: str) -> list[str | None]:
        return [seen.get(name) for seen in self.seen]


OPENAI3 = openai.__version__.startswith("3.")


@pytest.fixture
def http(lib: ModuleType) -> ModuleType:
    if lib.__name__ == "httpx2" and not OPENAI3:
        pytest.skip("openai 2.x takes httpx clients only")
    return lib


@pytest.fixture
def server(serve: Callable[[Any], str]) -> tuple[Counting, str]:
    counting = Counting()
    return counting, serve(counting.app())


def keys() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"key-{next(numbers)}"


def test_the_api_key_provider_is_asked_per_attempt(server: tuple[Counting, str]) -> None:
    counting, url = server
    wrapped = llm_backoff.wrap(openai.OpenAI(base_url=f"{url}/v1", api_key=keys()))
    with instant_retries():
        reply = wrapped.chat.completions.create(model="m", messages=MESSAGES)
    assert reply.choices[0].message.content == "ok"
    assert counting.header("authorization") == ["Bearer key-0", "Bearer key-1", "Bearer key-2"]
    assert counting.header("x-stainless-retry-count") == ["0", "1", "2"]


async def test_the_async_api_key_provider_is_awaited_per_attempt(server: tuple[Counting, str]) -> None:
    counting, url = server
    numbers = itertools.count()

    async def provider() -> str:
        return f"key-{next(numbers)}"

    wrapped = llm_backoff.wrap(openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=provider))
    with instant_retries():
        await wrapped.chat.completions.create(model="m", messages=MESSAGES)
    assert counting.header("authorization") == ["Bearer key-0", "Bearer key-1", "Bearer key-2"]


def test_a_derived_client_asks_its_own_provider(server: tuple[Counting, str]) -> None:
    counting, url = server
    wrapped = llm_backoff.wrap(openai.OpenAI(base_url=f"{url}/v1", api_key=keys()))
    derived = wrapped.with_options(timeout=30)
    with instant_retries():
        derived.chat.completions.create(model="m", messages=MESSAGES)
    assert counting.header("authorization") == ["Bearer key-0", "Bearer key-1", "Bearer key-2"]


def test_an_authorization_the_call_sets_itself_is_left_alone(server: tuple[Counting, str]) -> None:
    counting, url = server
    wrapped = llm_backoff.wrap(openai.OpenAI(base_url=f"{url}/v1", api_key=keys()))
    with instant_retries():
        wrapped.chat.completions.create(
            model="m", messages=MESSAGES, extra_headers={"Authorization": "Bearer mine"}
        )
    assert counting.header("authorization") == ["Bearer mine"] * 3


def test_a_static_key_is_sent_unchanged(server: tuple[Counting, str]) -> None:
    counting, url = server
    wrapped = llm_backoff.wrap(openai.OpenAI(base_url=f"{url}/v1", api_key="static"))
    with instant_retries():
        wrapped.chat.completions.create(model="m", messages=MESSAGES)
    assert counting.header("authorization") == ["Bearer static"] * 3


def test_the_azure_ad_token_provider_is_asked_per_attempt(server: tuple[Counting, str]) -> None:
    counting, url = server
    wrapped = llm_backoff.wrap(
        openai.AzureOpenAI(
            azure_endpoint=url,
            azure_deployment="dep",
            api_version="2024-06-01",
            azure_ad_token_provider=keys(),
        )
    )
    with instant_retries():
        wrapped.chat.completions.create(model="m", messages=MESSAGES)
    assert counting.header("authorization") == ["Bearer key-0", "Bearer key-1", "Bearer key-2"]


def test_request_event_hooks_run_per_attempt(server: tuple[Counting, str], http: ModuleType) -> None:
    counting, url = server
    signed = itertools.count()

    def sign(request: Any) -> None:
        request.headers["x-signature"] = f"sig-{next(signed)}"

    http_client = http.Client(event_hooks={"request": [sign]})
    wrapped = llm_backoff.wrap(openai.OpenAI(base_url=f"{url}/v1", api_key="k", http_client=http_client))
    with instant_retries():
        wrapped.chat.completions.create(model="m", messages=MESSAGES)
    assert counting.header("x-signature") == ["sig-0", "sig-1", "sig-2"]
    http_client.close()


async def test_async_request_event_hooks_run_per_attempt(
    server: tuple[Counting, str], http: ModuleType
) -> None:
    counting, url = server
    signed = itertools.count()

    async def sign(request: Any) -> None:
        request.headers["x-signature"] = f"sig-{next(signed)}"

    http_client = http.AsyncClient(event_hooks={"request": [sign]})
    wrapped = llm_backoff.wrap(openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", http_client=http_client))
    with instant_retries():
        await wrapped.chat.completions.create(model="m", messages=MESSAGES)
    assert counting.header("x-signature") == ["sig-0", "sig-1", "sig-2"]
    await http_client.aclose()


def test_a_provider_failing_on_a_retry_ends_the_call_with_its_error(server: tuple[Counting, str]) -> None:
    counting, url = server
    answers = iter(["key-0", ""])
    wrapped = llm_backoff.wrap(openai.OpenAI(base_url=f"{url}/v1", api_key=lambda: next(answers)))
    # openai 3.x lets the error through; 2.x wraps any error of its http client in APIConnectionError
    with instant_retries(), pytest.raises((ValueError, openai.APIConnectionError)) as caught:
        wrapped.chat.completions.create(model="m", messages=MESSAGES)
    error = caught.value if isinstance(caught.value, ValueError) else caught.value.__cause__
    assert "api_key provider returned '' for a retry, expected a non-empty str" in str(error)
    assert len(counting.seen) == 1
