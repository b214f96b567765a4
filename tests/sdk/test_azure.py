"""wrap() over AzureOpenAI / AsyncAzureOpenAI: same class, Azure's URL, query and auth kept.

A mock transport stands in for the Azure endpoint (no network): it records the URL,
the ``api-version`` query and the auth headers of every attempt.
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
ENDPOINT = "https://example-resource.openai.azure.com"
API_VERSION = "2024-06-01"
MESSAGES: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture
def http(lib: ModuleType) -> ModuleType:
    if lib.__name__ == "httpx2" and not OPENAI3:
        pytest.skip("openai 2.x takes httpx clients only")
    return lib


class AzureEndpoint:
    """Answers ``busy`` 429s, then a chat completion; keeps what each attempt sent."""

    def __init__(self, http: ModuleType, busy: int = 1) -> None:
        self.http = http
        self.busy = busy
        self.seen: list[dict[str, Any]] = []

    def __call__(self, request: Any) -> Any:
        self.seen.append(
            {
                "path": request.url.path,
                "api-version": request.url.params.get("api-version"),
                "api-key": request.headers.get("api-key"),
                "authorization": request.headers.get("authorization"),
                "x-request-timeout-ms": request.headers.get("x-request-timeout-ms"),
            }
        )
        if len(self.seen) <= self.busy:
            return self.http.Response(
                429, headers={"retry-after-ms": "5"}, json={"error": {"message": "busy", "code": "429"}}
            )
        return self.http.Response(
            200,
            json={
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "gpt-4o",
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}
                ],
            },
        )


def test_wrapped_azure_client_keeps_class_deployment_url_version_and_key(http: ModuleType) -> None:
    endpoint = AzureEndpoint(http, busy=2)
    original = openai.AzureOpenAI(
        api_key="azure-key",
        api_version=API_VERSION,
        azure_endpoint=ENDPOINT,
        azure_deployment="my-deployment",
        max_retries=3,
        http_client=http.Client(transport=http.MockTransport(endpoint)),
    )
    wrapped = llm_backoff.wrap(original, RetryPolicy(retry_after_jitter=0))
    assert type(wrapped) is openai.AzureOpenAI
    assert wrapped.max_retries == 0
    assert original.max_retries == 3
    with instant_retries():
        result = wrapped.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert result.choices[0].message.content == "hi"
    assert len(endpoint.seen) == 3
    for attempt in endpoint.seen:
        assert attempt["path"] == "/openai/deployments/my-deployment/chat/completions"
        assert attempt["api-version"] == API_VERSION
        assert attempt["api-key"] == "azure-key"
        # what openai sends: openai 2.0 also sent the key as a bearer token, later ones do not
        assert attempt["authorization"] in (None, "Bearer azure-key")
        assert attempt["x-request-timeout-ms"] is not None


def test_azure_without_a_deployment_routes_by_model(http: ModuleType) -> None:
    endpoint = AzureEndpoint(http, busy=1)
    wrapped = llm_backoff.wrap(
        openai.AzureOpenAI(
            api_key="azure-key",
            api_version=API_VERSION,
            azure_endpoint=ENDPOINT,
            http_client=http.Client(transport=http.MockTransport(endpoint)),
        )
    )
    with instant_retries():
        wrapped.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert [a["path"] for a in endpoint.seen] == ["/openai/deployments/gpt-4o-mini/chat/completions"] * 2


def test_azure_ad_token_provider_is_asked_per_attempt_and_derived_clients_keep_azure(
    http: ModuleType,
) -> None:
    endpoint = AzureEndpoint(http, busy=1)
    tokens = iter(f"token-{i}" for i in range(100))
    wrapped = llm_backoff.wrap(
        openai.AzureOpenAI(
            azure_ad_token_provider=lambda: next(tokens),
            api_version=API_VERSION,
            azure_endpoint=ENDPOINT,
            azure_deployment="dep",
            http_client=http.Client(transport=http.MockTransport(endpoint)),
        )
    )
    derived = wrapped.with_options(timeout=12.0)
    assert type(derived) is openai.AzureOpenAI
    with instant_retries():
        derived.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    # as openai's own retries do, each attempt asks the provider again (a token may expire meanwhile)
    assert [a["authorization"] for a in endpoint.seen] == ["Bearer token-0", "Bearer token-1"]
    assert {a["path"] for a in endpoint.seen} == {"/openai/deployments/dep/chat/completions"}
    assert {a["api-version"] for a in endpoint.seen} == {API_VERSION}
    assert llm_backoff.client_stats(derived).retries == 1


def test_azure_error_keeps_its_type_and_history(http: ModuleType) -> None:
    endpoint = AzureEndpoint(http, busy=100)
    wrapped = llm_backoff.wrap(
        openai.AzureOpenAI(
            api_key="azure-key",
            api_version=API_VERSION,
            azure_endpoint=ENDPOINT,
            azure_deployment="dep",
            http_client=http.Client(transport=http.MockTransport(endpoint)),
        ),
        RetryPolicy(max_attempts=2),
    )
    with instant_retries(), pytest.raises(openai.RateLimitError) as info:
        wrapped.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert [a.status for a in info.value.llm_backoff_attempts] == [429, 429]  # type: ignore[attr-defined]


async def test_wrapped_async_azure_client(http: ModuleType) -> None:
    endpoint = AzureEndpoint(http, busy=1)
    original = openai.AsyncAzureOpenAI(
        api_key="azure-key",
        api_version=API_VERSION,
        azure_endpoint=ENDPOINT,
        azure_deployment="my-deployment",
        http_client=http.AsyncClient(transport=http.MockTransport(endpoint)),
    )
    wrapped = llm_backoff.wrap(original)
    assert type(wrapped) is openai.AsyncAzureOpenAI
    with instant_retries():
        result = await wrapped.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert result.choices[0].message.content == "hi"
    assert len(endpoint.seen) == 2
    assert {a["path"] for a in endpoint.seen} == {"/openai/deployments/my-deployment/chat/completions"}
    assert {a["api-version"] for a in endpoint.seen} == {API_VERSION}
    assert {a["api-key"] for a in endpoint.seen} == {"azure-key"}
    await wrapped.close()
