"""tenacity strategies: wait_retry_after and retry_if_retryable, alone and composed."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import openai
import pytest
import tenacity

from llm_backoff import RetryPolicy, retry_if_retryable, wait_retry_after


def state_for(outcome: BaseException | Any, *, failed: bool = True) -> tenacity.RetryCallState:
    state = tenacity.RetryCallState(retry_object=tenacity.Retrying(), fn=None, args=(), kwargs={})
    if failed:
        state.set_exception((type(outcome), outcome, None))
    else:
        state.set_result(outcome)
    return state


def status_error(
    lib: ModuleType, status: int, headers: dict[str, str], body: Any = None
) -> openai.APIStatusError:
    request = lib.Request("POST", "http://x/v1/chat/completions")
    response = lib.Response(status, headers=headers, json=body if body is not None else {}, request=request)
    cls = {429: openai.RateLimitError, 400: openai.BadRequestError}.get(status, openai.InternalServerError)
    return cls("err", response=response, body=(body or {}).get("error", body))


@pytest.fixture
def olib(lib: ModuleType) -> ModuleType:
    """The http library whose responses this openai version's exceptions hold."""
    if lib.__name__ == "httpx2" and not openai.__version__.startswith("3."):
        pytest.skip("openai 2.x is built on httpx")
    return lib


def test_wait_uses_the_hint_from_an_openai_error(olib: ModuleType) -> None:
    wait = wait_retry_after(tenacity.wait_fixed(9))
    assert wait(state_for(status_error(olib, 429, {"retry-after": "2"}))) == 2.0
    assert wait(state_for(status_error(olib, 503, {"retry-after-ms": "250"}))) == 0.25
    body = {"error": {"message": "full", "retry_after_seconds": 1.5}}
    assert wait(state_for(status_error(olib, 429, {}, body))) == 1.5


def test_wait_falls_back_without_a_usable_hint(olib: ModuleType) -> None:
    wait = wait_retry_after(tenacity.wait_fixed(9))
    assert wait(state_for(status_error(olib, 429, {}))) == 9
    assert wait(state_for(status_error(olib, 429, {"retry-after": "garbage"}))) == 9
    assert wait(state_for(status_error(olib, 429, {"retry-after": "-3"}))) == 9
    assert wait(state_for(ValueError("no response"))) == 9


def test_wait_reads_returned_responses_and_http_status_errors(lib: ModuleType) -> None:
    wait = wait_retry_after(tenacity.wait_fixed(1))
    response = lib.Response(429, headers={"retry-after": "4"}, request=lib.Request("GET", "http://x"))
    assert wait(state_for(response, failed=False)) == 4.0
    error = lib.HTTPStatusError("busy", request=response.request, response=response)
    assert wait(state_for(error)) == 4.0


def test_wait_composes_with_plus(olib: ModuleType) -> None:
    wait = wait_retry_after(tenacity.wait_fixed(5)) + tenacity.wait_fixed(0.5)
    assert wait(state_for(status_error(olib, 429, {"retry-after": "2"}))) == 2.5
    assert wait(state_for(status_error(olib, 429, {}))) == 5.5


def test_retry_predicate_follows_the_policy(olib: ModuleType) -> None:
    retry = retry_if_retryable(RetryPolicy())
    assert retry(state_for(status_error(olib, 429, {})))
    assert retry(state_for(status_error(olib, 503, {})))
    assert not retry(state_for(status_error(olib, 400, {})))
    assert not retry(state_for(status_error(olib, 503, {"x-should-retry": "false"})))
    quota = {"error": {"type": "insufficient_quota", "code": "insufficient_quota"}}
    assert not retry(state_for(status_error(olib, 429, {}, quota)))
    assert not retry(state_for(status_error(olib, 429, {"retry-after": "500"})))  # above max_retry_after
    assert not retry_if_retryable(RetryPolicy(retry_statuses=[503]))(state_for(status_error(olib, 429, {})))


def test_retry_predicate_gives_up_on_a_hint_that_would_begin_the_retry_past_max_retry_at(
    olib: ModuleType,
) -> None:
    retry = retry_if_retryable(RetryPolicy(max_retry_at=3))
    fresh = state_for(status_error(olib, 429, {"retry-after": "2"}))
    assert retry(fresh)  # begun just now: the retry would begin at about 2 s
    late = state_for(status_error(olib, 429, {"retry-after": "2"}))
    late.start_time -= 2.0  # the call began 2 s ago: the retry would begin at about 4 s
    assert not retry(late)
    assert "max_retry_at" in retry.verdict(late).reason


def test_retry_predicate_on_transport_errors_and_values(olib: ModuleType) -> None:
    request = olib.Request("GET", "http://x")
    retry = retry_if_retryable()
    assert retry(state_for(openai.APITimeoutError(request=request)))
    assert retry(state_for(openai.APIConnectionError(request=request)))
    assert retry(state_for(olib.ConnectError("refused", request=request)))
    assert not retry_if_retryable(RetryPolicy(retry_timeouts=False))(
        state_for(openai.APITimeoutError(request=request))
    )
    assert not retry(state_for(ValueError("bug")))
    assert not retry(state_for("a value", failed=False))
    assert not retry(state_for(olib.Response(200, request=request), failed=False))
    assert retry(state_for(olib.Response(503, request=request), failed=False))


def test_retry_predicate_composes_with_or_and_and(olib: ModuleType) -> None:
    either = retry_if_retryable() | tenacity.retry_if_exception_type(KeyError)
    assert either(state_for(KeyError("k")))
    assert either(state_for(status_error(olib, 429, {})))
    both = retry_if_retryable() & tenacity.retry_if_exception_type(openai.RateLimitError)
    assert both(state_for(status_error(olib, 429, {})))
    assert not both(state_for(status_error(olib, 503, {})))


def test_a_tenacity_loop_driven_by_our_strategies(olib: ModuleType) -> None:
    calls: list[int] = []
    slept: list[float] = []

    @tenacity.retry(
        retry=retry_if_retryable(),
        wait=wait_retry_after(tenacity.wait_fixed(0.1)),
        stop=tenacity.stop_after_attempt(5),
        sleep=slept.append,
        reraise=True,
    )
    def call() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise status_error(olib, 429, {"retry-after": "3"})
        if len(calls) == 2:
            raise openai.APIConnectionError(request=olib.Request("GET", "http://x"))
        return "done"

    assert call() == "done"
    assert slept == [3.0, 0.1]
