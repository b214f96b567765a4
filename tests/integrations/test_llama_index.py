"""llama-index's OpenAILike on wrapped clients rides out a shim's 429 (docs/integrations.md).

llama-index-llms-openai pins openai<3: these tests run in an openai 2.x venv.
"""

from __future__ import annotations

import openai
import pytest

import llm_backoff

from .rig import FIVE_TOKENS, Rig, assert_rode_out_one_refusal

pytestmark = pytest.mark.integrations
openai_like = pytest.importorskip("llama_index.llms.openai_like")
from llama_index.core.llms import ChatMessage  # noqa: E402


def recipe(rig: Rig) -> tuple[object, openai.OpenAI, openai.AsyncOpenAI]:
    w = llm_backoff.wrap(openai.OpenAI(base_url=rig.url, api_key="sk-unused"))
    aw = llm_backoff.wrap(openai.AsyncOpenAI(base_url=rig.url, api_key="sk-unused"))
    llm = openai_like.OpenAILike(
        model="sim-model",
        api_base=rig.url,
        api_key="sk-unused",
        is_chat_model=True,
        max_tokens=5,
        max_retries=0,  # llama-index's own retry loop off: the wrapped clients retry
        openai_client=w,
        async_openai_client=aw,
    )
    rig.release_on_retry(w, aw)
    return llm, w, aw


def test_complete_rides_out_a_429(rig: Rig) -> None:
    llm, w, aw = recipe(rig)
    rig.hold()
    assert llm.complete("hello").text == FIVE_TOKENS  # type: ignore[attr-defined]
    assert_rode_out_one_refusal(rig, w, aw)


def test_chat_rides_out_a_429(rig: Rig) -> None:
    llm, w, aw = recipe(rig)
    rig.hold()
    reply = llm.chat([ChatMessage(role="user", content="hello")])  # type: ignore[attr-defined]
    assert reply.message.content == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, w, aw)


def test_stream_complete_rides_out_a_429(rig: Rig) -> None:
    llm, w, aw = recipe(rig)
    rig.hold()
    text = "".join(r.delta or "" for r in llm.stream_complete("hello"))  # type: ignore[attr-defined]
    assert text == FIVE_TOKENS
    assert_rode_out_one_refusal(rig, w, aw)


async def test_acomplete_rides_out_a_429(rig: Rig) -> None:
    llm, w, aw = recipe(rig)
    rig.hold()
    assert (await llm.acomplete("hello")).text == FIVE_TOKENS  # type: ignore[attr-defined]
    assert_rode_out_one_refusal(rig, w, aw)


def test_when_retries_end_the_error_is_the_openai_rate_limit_error(rig: Rig) -> None:
    w = llm_backoff.wrap(
        openai.OpenAI(base_url=rig.url, api_key="sk-unused"), llm_backoff.RetryPolicy(max_attempts=2)
    )
    llm = openai_like.OpenAILike(
        model="sim-model",
        api_base=rig.url,
        api_key="sk-unused",
        is_chat_model=True,
        max_tokens=5,
        max_retries=0,
        openai_client=w,
    )
    rig.hold()  # never let go: both attempts are refused
    with pytest.raises(openai.RateLimitError) as caught:
        llm.complete("hello")
    assert [a.status for a in caught.value.llm_backoff_attempts] == [429, 429]  # type: ignore[attr-defined]
    assert rig.refused() == {"queue_full": 2.0}  # with max_retries=0 llama-index did not send it again
