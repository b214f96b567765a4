"""openai-agents on a wrapped client rides out a shim's 429 (docs/integrations.md).

``set_default_openai_client`` and friends set process-wide defaults; each test sets
all of them itself, so the order the tests run in does not matter.
"""

from __future__ import annotations

import openai
import pytest

import llm_backoff

from .rig import FIVE_TOKENS, Rig, assert_rode_out_one_refusal

pytestmark = pytest.mark.integrations
agents = pytest.importorskip("agents")


def recipe(rig: Rig) -> openai.AsyncOpenAI:
    aw = llm_backoff.wrap(openai.AsyncOpenAI(base_url=rig.url, api_key="sk-unused"))
    agents.set_default_openai_client(aw, use_for_tracing=False)
    agents.set_default_openai_api("chat_completions")  # the simulator serves no /v1/responses
    agents.set_tracing_disabled(True)  # traces would otherwise be uploaded to OpenAI
    rig.release_on_retry(aw)
    return aw


def agent(**options: object) -> object:
    return agents.Agent(
        name="assistant",
        instructions="Answer briefly.",
        model_settings=agents.ModelSettings(max_tokens=5),
        **options,
    )


def test_run_sync_rides_out_a_429(rig: Rig) -> None:
    aw = recipe(rig)
    rig.hold()
    result = agents.Runner.run_sync(agent(model="sim-model"), "hello")
    assert result.final_output == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, aw)


async def test_run_rides_out_a_429(rig: Rig) -> None:
    aw = recipe(rig)
    rig.hold()
    result = await agents.Runner.run(agent(model="sim-model"), "hello")
    assert result.final_output == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, aw)


async def test_run_streamed_rides_out_a_429(rig: Rig) -> None:
    aw = recipe(rig)
    rig.hold()
    result = agents.Runner.run_streamed(agent(model="sim-model"), "hello")
    async for _event in result.stream_events():
        pass
    assert result.final_output == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, aw)


async def test_a_model_of_its_own_rides_out_a_429(rig: Rig) -> None:
    # The form without process-wide defaults: the wrapped client handed to one model.
    agents.set_tracing_disabled(True)
    aw = llm_backoff.wrap(openai.AsyncOpenAI(base_url=rig.url, api_key="sk-unused"))
    rig.release_on_retry(aw)
    model = agents.OpenAIChatCompletionsModel(model="sim-model", openai_client=aw)
    rig.hold()
    result = await agents.Runner.run(agent(model=model), "hello")
    assert result.final_output == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, aw)


def test_when_retries_end_the_error_is_the_openai_rate_limit_error(rig: Rig) -> None:
    aw = llm_backoff.wrap(
        openai.AsyncOpenAI(base_url=rig.url, api_key="sk-unused"), llm_backoff.RetryPolicy(max_attempts=2)
    )
    agents.set_default_openai_client(aw, use_for_tracing=False)
    agents.set_default_openai_api("chat_completions")
    agents.set_tracing_disabled(True)
    rig.hold()  # never let go: both attempts are refused
    with pytest.raises(openai.RateLimitError) as caught:
        agents.Runner.run_sync(agent(model="sim-model"), "hello")
    assert [a.status for a in caught.value.llm_backoff_attempts] == [429, 429]  # type: ignore[attr-defined]
    assert rig.refused() == {"queue_full": 2.0}
