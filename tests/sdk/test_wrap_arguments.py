"""`wrap()` checks every argument up front, with a message naming it and what it takes."""

from __future__ import annotations

from typing import Any

import openai
import pytest

import llm_backoff


def client() -> openai.OpenAI:
    return openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k")


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"request_class": 5}, TypeError, r"request_class must be a str such as 'interactive'.*got int"),
        ({"request_class": b"batch"}, TypeError, r"request_class must be a str.*got bytes"),
        ({"request_class": ""}, ValueError, r"request_class must be a non-empty printable ASCII"),
        ({"request_class": "a\r\nx-evil: 1"}, ValueError, r"request_class must be .*printable ASCII"),
        ({"request_class": "interaktiv\u00e9"}, ValueError, r"request_class must be .*ASCII"),
        ({"policy": {"deadline": 5}}, TypeError, r"policy must be a llm_backoff.RetryPolicy.*got dict"),
        ({"on_retry": 5}, TypeError, r"on_retry must be a callable taking a RetryEvent.*got int"),
        ({"on_retry": "print"}, TypeError, r"on_retry must be a callable.*got str"),
        ({"on_retry": [print, 5]}, TypeError, r"on_retry must hold only callables.*got int"),
        ({"limiter": object()}, TypeError, r"limiter must implement llm_backoff.limits.CallLimiter"),
        ({"limiter": llm_backoff.RetryBudget()}, TypeError, r"limiter must implement.*got RetryBudget"),
        ({"budget": 0.1}, TypeError, r"budget must implement record_request\(\) and try_spend\(\).*float"),
    ],
)
def test_a_bad_argument_is_named_with_what_it_takes(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        llm_backoff.wrap(client(), **kwargs)


def test_a_bad_client_is_named() -> None:
    with pytest.raises(llm_backoff.UnsupportedClientError, match=r"wrap\(\) takes an openai.OpenAI.*got int"):
        llm_backoff.wrap(5)
    with pytest.raises(TypeError):  # UnsupportedClientError is a TypeError
        llm_backoff.wrap(object())


def test_good_arguments_of_every_accepted_shape_are_taken() -> None:
    seen: list[Any] = []
    observers = llm_backoff.RetryObservers([seen.append])
    for on_retry in (seen.append, [seen.append, print], (seen.append,), observers, None):
        wrapped = llm_backoff.wrap(
            client(),
            llm_backoff.RetryPolicy(deadline=5),
            on_retry=on_retry,
            request_class="batch",
            limiter=llm_backoff.RateLimiter(requests_per_second=100),
            budget=llm_backoff.RetryBudget(),
        )
        assert type(wrapped) is openai.OpenAI
    assert llm_backoff.retry_observers(llm_backoff.wrap(client(), on_retry=observers)) is observers
