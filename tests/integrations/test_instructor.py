"""instructor on a wrapped client rides out a shim's 429 and still parses its model (docs/integrations.md).

The simulator answers ``token0 token1 ...``, which no response model parses, so these
tests put the shim in front of an upstream that answers one JSON document.
"""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel

import llm_backoff

from .rig import Rig, assert_rode_out_one_refusal

pytestmark = pytest.mark.integrations
instructor = pytest.importorskip("instructor")


class Person(BaseModel):
    name: str
    born: int


MESSAGES = [{"role": "user", "content": "Who wrote the first program?"}]


def test_create_rides_out_a_429(json_rig: Rig) -> None:
    w = llm_backoff.wrap(openai.OpenAI(base_url=json_rig.url, api_key="sk-unused"))
    client = instructor.from_openai(w, mode=instructor.Mode.JSON)
    json_rig.release_on_retry(w)
    json_rig.hold()
    person = client.chat.completions.create(model="json-model", response_model=Person, messages=MESSAGES)
    assert person.model_dump() == {"name": "Ada Lovelace", "born": 1815}
    assert_rode_out_one_refusal(json_rig, w)


async def test_async_create_rides_out_a_429(json_rig: Rig) -> None:
    aw = llm_backoff.wrap(openai.AsyncOpenAI(base_url=json_rig.url, api_key="sk-unused"))
    client = instructor.from_openai(aw, mode=instructor.Mode.JSON)
    json_rig.release_on_retry(aw)
    json_rig.hold()
    person = await client.chat.completions.create(
        model="json-model", response_model=Person, messages=MESSAGES
    )
    assert person.model_dump() == {"name": "Ada Lovelace", "born": 1815}
    assert_rode_out_one_refusal(json_rig, aw)


def test_when_retries_end_instructor_wraps_the_openai_error(json_rig: Rig) -> None:
    from instructor.core import InstructorRetryException

    w = llm_backoff.wrap(
        openai.OpenAI(base_url=json_rig.url, api_key="sk-unused"), llm_backoff.RetryPolicy(max_attempts=2)
    )
    client = instructor.from_openai(w, mode=instructor.Mode.JSON)
    json_rig.hold()  # never let go: both attempts are refused
    with pytest.raises(InstructorRetryException) as caught:
        client.chat.completions.create(model="json-model", response_model=Person, messages=MESSAGES)
    cause = caught.value.__cause__
    assert isinstance(cause, openai.RateLimitError)
    assert [a.status for a in cause.llm_backoff_attempts] == [429, 429]  # type: ignore[attr-defined]
    assert json_rig.refused() == {"queue_full": 2.0}  # instructor did not send it again
