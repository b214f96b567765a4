"""pydantic-ai with a wrapped client rides out a shim's 429; unretried, the 429 is a ModelOverloadedError."""

from __future__ import annotations

import openai
import pytest

import llm_backoff

from .rig import FIVE_TOKENS, Rig, assert_rode_out_one_refusal

pytestmark = pytest.mark.integrations
pydantic_ai = pytest.importorskip("pydantic_ai")
from pydantic_ai.exceptions import (  # noqa: E402
    ModelHTTPError,
    ModelOverloadedError,
    ModelRateLimitError,
    ModelUnavailableError,
)
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402


def agent_on(client: openai.AsyncOpenAI) -> pydantic_ai.Agent[None, str]:
    model = OpenAIChatModel("sim-model", provider=OpenAIProvider(openai_client=client))
    return pydantic_ai.Agent(model, model_settings={"max_tokens": 5})


def wrapped(rig: Rig, policy: llm_backoff.RetryPolicy | None = None) -> openai.AsyncOpenAI:
    return llm_backoff.wrap(openai.AsyncOpenAI(base_url=rig.url, api_key="sk-unused"), policy)


def test_run_sync_rides_out_a_429(rig: Rig) -> None:
    aw = wrapped(rig)
    rig.release_on_retry(aw)
    rig.hold()
    result = agent_on(aw).run_sync("hello")
    assert result.output == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, aw)


async def test_run_rides_out_a_429(rig: Rig) -> None:
    aw = wrapped(rig)
    rig.release_on_retry(aw)
    rig.hold()
    result = await agent_on(aw).run("hello")
    assert result.output == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, aw)


async def test_run_stream_rides_out_a_429(rig: Rig) -> None:
    aw = wrapped(rig)
    rig.release_on_retry(aw)
    rig.hold()
    async with agent_on(aw).run_stream("hello") as run:
        text = await run.get_output()
    assert text == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, aw)


async def test_an_unretried_shim_429_is_a_model_overloaded_error_not_a_rate_limit_error(rig: Rig) -> None:
    # What a caller sees when nothing retries (a plain client, or a wrapped one out of
    # attempts): the shim's type "server_overloaded" makes it a ModelOverloadedError.
    plain = openai.AsyncOpenAI(base_url=rig.url, api_key="sk-unused", max_retries=0)
    rig.hold()
    with pytest.raises(ModelOverloadedError) as caught:
        await agent_on(plain).run("hello")
    error = caught.value
    assert not isinstance(error, ModelRateLimitError)
    assert isinstance(error, ModelUnavailableError)
    assert isinstance(error, ModelHTTPError)
    assert error.status_code == 429
    assert error.provider_error_type == "server_overloaded"
    assert error.provider_error_code == "queue_full"
    assert error.retry_after is not None
    assert 0 < error.retry_after <= 0.2  # the shim's retry-after-ms, within its configured range
    assert isinstance(error.__cause__, openai.RateLimitError)
    assert rig.refused() == {"queue_full": 1.0}


async def test_a_wrapped_client_out_of_attempts_raises_what_the_recipe_catches(rig: Rig) -> None:
    aw = wrapped(rig, llm_backoff.RetryPolicy(max_attempts=2))
    rig.hold()  # never let go: both attempts are refused
    try:
        await agent_on(aw).run("hello")
    except (ModelRateLimitError, ModelUnavailableError) as error:  # the recipe's except clause
        caught: BaseException = error
    assert isinstance(caught, ModelOverloadedError)
    cause = caught.__cause__
    assert isinstance(cause, openai.RateLimitError)
    assert [a.status for a in cause.llm_backoff_attempts] == [429, 429]  # type: ignore[attr-defined]
    assert rig.refused() == {"queue_full": 2.0}


async def test_model_settings_max_retries_multiplies_the_attempts(rig: Rig) -> None:
    # Why the recipe leaves ModelSettings["max_retries"] unset: pydantic-ai then sends
    # through a copy of the client with openai's own retries on, and each of openai's
    # tries is one whole llm_backoff call: 3 tries x 2 attempts reach the shim.
    aw = wrapped(rig, llm_backoff.RetryPolicy(max_attempts=2))
    model = OpenAIChatModel("sim-model", provider=OpenAIProvider(openai_client=aw))
    agent = pydantic_ai.Agent(model, model_settings={"max_tokens": 5, "max_retries": 2})
    rig.hold()  # never let go
    with pytest.raises(ModelOverloadedError):
        await agent.run("hello")
    assert rig.refused() == {"queue_full": 6.0}


async def test_a_tenant_quota_429_is_a_model_rate_limit_error(rig: Rig) -> None:
    # The shim's other 429, a tenant over its quota, says "rate_limit_exceeded".
    quota = Rig(rig.upstream, tenant_requests_per_minute=1)
    try:
        plain = openai.AsyncOpenAI(base_url=quota.url, api_key="sk-tenant", max_retries=0)
        assert (await agent_on(plain).run("hello")).output == FIVE_TOKENS
        with pytest.raises(ModelRateLimitError) as caught:
            await agent_on(plain).run("hello")
        assert not isinstance(caught.value, ModelUnavailableError)
        assert caught.value.provider_error_type == "rate_limit_exceeded"
        assert caught.value.provider_error_code == "tenant_rate_limited"
        assert quota.refused() == {"tenant_rate_limited": 1.0}
    finally:
        quota.close()
