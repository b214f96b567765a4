"""LangChain (langchain-openai) with wrapped clients rides out a shim's 429 (docs/integrations.md)."""

from __future__ import annotations

import openai
import pytest

import llm_backoff

from .rig import FIVE_TOKENS, Rig, assert_rode_out_one_refusal

pytestmark = pytest.mark.integrations
langchain_openai = pytest.importorskip("langchain_openai")


def chat_model(
    rig: Rig, policy: llm_backoff.RetryPolicy | None = None
) -> tuple[object, openai.OpenAI, openai.AsyncOpenAI]:
    # The recipe: all four clients, the resource clients and the root clients.
    w = llm_backoff.wrap(openai.OpenAI(base_url=rig.url, api_key="sk-unused"), policy)
    aw = llm_backoff.wrap(openai.AsyncOpenAI(base_url=rig.url, api_key="sk-unused"), policy)
    llm = langchain_openai.ChatOpenAI(
        model="sim-model",
        max_tokens=5,
        client=w.chat.completions,
        async_client=aw.chat.completions,
        root_client=w,
        root_async_client=aw,
    )
    return llm, w, aw


def test_invoke_rides_out_a_429(rig: Rig) -> None:
    llm, w, aw = chat_model(rig)
    rig.release_on_retry(w, aw)
    rig.hold()
    reply = llm.invoke("hello")  # type: ignore[attr-defined]
    assert reply.content == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, w, aw)


async def test_ainvoke_rides_out_a_429(rig: Rig) -> None:
    llm, w, aw = chat_model(rig)
    rig.release_on_retry(w, aw)
    rig.hold()
    reply = await llm.ainvoke("hello")  # type: ignore[attr-defined]
    assert reply.content == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, w, aw)


def test_stream_rides_out_a_429(rig: Rig) -> None:
    llm, w, aw = chat_model(rig)
    rig.release_on_retry(w, aw)
    rig.hold()
    text = "".join(str(chunk.content) for chunk in llm.stream("hello"))  # type: ignore[attr-defined]
    assert text == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, w, aw)


def test_root_client_alone_is_replaced_by_a_client_of_langchains_own(rig: Rig) -> None:
    # Why the recipe passes all four: given only root_client, ChatOpenAI builds its own
    # unwrapped clients and uses those, silently.
    w = llm_backoff.wrap(openai.OpenAI(base_url=rig.url, api_key="sk-unused"))
    llm = langchain_openai.ChatOpenAI(model="sim-model", api_key="sk-unused", base_url=rig.url, root_client=w)
    assert llm.root_client is not w
    with pytest.raises(llm_backoff.UnsupportedClientError):
        llm_backoff.client_stats(llm.root_client)


def test_when_retries_end_the_error_is_an_openai_rate_limit_error(rig: Rig) -> None:
    llm, _, _ = chat_model(rig, llm_backoff.RetryPolicy(max_attempts=2))
    rig.hold()  # never let go: both attempts are refused
    with pytest.raises(openai.RateLimitError) as caught:
        llm.invoke("hello")  # type: ignore[attr-defined]
    # langchain re-raises it as its own subclass, which is a langchain ModelRateLimitError too.
    from langchain_core.exceptions import ModelRateLimitError

    assert isinstance(caught.value, ModelRateLimitError)
    cause = caught.value.__cause__
    assert isinstance(cause, openai.RateLimitError)
    assert [a.status for a in cause.llm_backoff_attempts] == [429, 429]  # type: ignore[attr-defined]
    assert rig.refused() == {"queue_full": 2.0}


def test_sync_clients_alone_leave_langchain_building_an_async_one(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Why the recipe passes the async pair too: without them ChatOpenAI makes its own
    # AsyncOpenAI (unwrapped) from the environment, and fails without OPENAI_API_KEY.
    w = llm_backoff.wrap(openai.OpenAI(base_url=rig.url, api_key="sk-unused"))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    llm = langchain_openai.ChatOpenAI(model="sim-model", client=w.chat.completions, root_client=w)
    assert llm.root_client is w
    with pytest.raises(llm_backoff.UnsupportedClientError):
        llm_backoff.client_stats(llm.root_async_client)
