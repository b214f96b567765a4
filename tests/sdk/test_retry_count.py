"""``x-stainless-retry-count`` counts our retries: 0 on the first attempt, then 1, 2, ...

openai stamps the header with its own retry number; `wrap` switches openai's retries
off, so without our count every attempt would say 0 and a server could not tell a
returning caller from a new one. Mock transports record the header per attempt (the
request object is reused across attempts, so the value is copied when it is seen).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import openai
import pytest

import llm_backoff
from llm_backoff import RetryPolicy
from llm_backoff.testing import instant_retries

OPENAI3 = openai.__version__.startswith("3.")
HEADER = "x-stainless-retry-count"


class Recorder:
    """429 (or a connection error) ``failures`` times, then 200; keeps the header of each attempt."""

    def __init__(self, lib: ModuleType, failures: int, *, connection_errors: bool = False) -> None:
        self.lib = lib
        self.failures = failures
        self.connection_errors = connection_errors
        self.counts: list[str | None] = []

    def __call__(self, request: Any) -> Any:
        self.counts.append(request.headers.get(HEADER))
        if len(self.counts) <= self.failures:
            if self.connection_errors:
                raise self.lib.ConnectError("refused", request=request)
            return self.lib.Response(
                429, headers={"retry-after-ms": "1"}, json={"error": {"message": "busy"}}
            )
        return self.lib.Response(200, json=completion())


def completion() -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}],
    }


def transports(lib: ModuleType) -> tuple[type[Any], type[Any]]:
    from llm_backoff import transport

    if lib.__name__ == "httpx2":
        return transport.Httpx2RetryTransport, transport.AsyncHttpx2RetryTransport
    return transport.HttpxRetryTransport, transport.AsyncHttpxRetryTransport


@pytest.mark.parametrize("connection_errors", [False, True])
def test_transport_counts_retries_in_the_header(lib: ModuleType, connection_errors: bool) -> None:
    recorder = Recorder(lib, 3, connection_errors=connection_errors)
    sync_cls, _ = transports(lib)
    # Three refused connections in a row would reach the default max_connect_errors (3).
    retrying = sync_cls(lib.MockTransport(recorder), RetryPolicy(max_connect_errors=None))
    with instant_retries(), lib.Client(transport=retrying) as client:
        response = client.post("http://api/v1/x", json={}, headers={HEADER: "0"})
    assert response.status_code == 200
    assert recorder.counts == ["0", "1", "2", "3"]


async def test_async_transport_counts_retries_in_the_header(lib: ModuleType) -> None:
    recorder = Recorder(lib, 2)
    _, async_cls = transports(lib)
    async with lib.AsyncClient(transport=async_cls(lib.MockTransport(recorder))) as client:
        with instant_retries():
            response = await client.post("http://api/v1/x", json={}, headers={HEADER: "0"})
    assert response.status_code == 200
    assert recorder.counts == ["0", "1", "2"]


def test_a_request_without_the_header_is_not_given_one(lib: ModuleType) -> None:
    recorder = Recorder(lib, 2)
    sync_cls, _ = transports(lib)
    with instant_retries(), lib.Client(transport=sync_cls(lib.MockTransport(recorder))) as client:
        assert client.get("http://api/x").status_code == 200
    assert recorder.counts == [None, None, None]


@pytest.mark.parametrize(("first", "then"), [("2", ["2", "3", "4"]), ("junk", ["junk", "1", "2"])])
def test_the_count_goes_on_from_the_value_openai_sent(lib: ModuleType, first: str, then: list[str]) -> None:
    # openai's own retries, if a caller switches them back on, number its calls: ours add to that.
    recorder = Recorder(lib, 2)
    sync_cls, _ = transports(lib)
    with instant_retries(), lib.Client(transport=sync_cls(lib.MockTransport(recorder))) as client:
        assert client.get("http://api/x", headers={HEADER: first}).status_code == 200
    assert recorder.counts == then


@pytest.fixture
def http(lib: ModuleType) -> ModuleType:
    if lib.__name__ == "httpx2" and not OPENAI3:
        pytest.skip("openai 2.x takes httpx clients only")
    return lib


def test_wrapped_openai_client_sends_0_1_2(http: ModuleType) -> None:
    recorder = Recorder(http, 2)
    client = llm_backoff.wrap(
        openai.OpenAI(
            api_key="sk-test",
            base_url="http://llm.test/v1",
            http_client=http.Client(transport=http.MockTransport(recorder)),
        ),
        RetryPolicy(retry_after_jitter=0),
    )
    with instant_retries():
        result = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert result.choices[0].message.content == "hi"
    assert recorder.counts == ["0", "1", "2"]
    # the next call is a new one again
    with instant_retries():
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert recorder.counts[3] == "0"


async def test_wrapped_async_openai_client_sends_0_1_2(http: ModuleType) -> None:
    recorder = Recorder(http, 2, connection_errors=True)
    client = llm_backoff.wrap(
        openai.AsyncOpenAI(
            api_key="sk-test",
            base_url="http://llm.test/v1",
            http_client=http.AsyncClient(transport=http.MockTransport(recorder)),
        )
    )
    with instant_retries():
        result = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert result.choices[0].message.content == "hi"
    assert recorder.counts == ["0", "1", "2"]
    await client.close()


def test_a_caller_who_omits_the_header_does_not_get_it(http: ModuleType) -> None:
    recorder = Recorder(http, 1)
    client = llm_backoff.wrap(
        openai.OpenAI(
            api_key="sk-test",
            base_url="http://llm.test/v1",
            http_client=http.Client(transport=http.MockTransport(recorder)),
        )
    )
    with instant_retries():
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], extra_headers={HEADER: openai.Omit()}
        )
    assert recorder.counts == [None, None]
