from __future__ import annotations

import pytest

from llm_backoff import RateLimitTimeout, RetryPolicy
from llm_backoff.classify import (
    classify_exception,
    classify_status,
    error_code,
    error_kind,
    is_insufficient_quota,
    parse_error_body,
    upstream_unreachable,
)

P = RetryPolicy()


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_default_retry_statuses(status: int) -> None:
    verdict = classify_status(P, status, {})
    assert verdict.retryable
    assert str(status) in verdict.reason


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_never_retried_even_when_the_server_says_so(status: int) -> None:
    assert not classify_status(P, status, {"x-should-retry": "true"}).retryable


@pytest.mark.parametrize("status", [200, 201, 204, 302])
def test_success_is_not_retried(status: int) -> None:
    assert not classify_status(P, status, {}).retryable


def test_other_statuses_follow_the_policy() -> None:
    assert not classify_status(P, 409, {}).retryable
    assert not classify_status(P, 501, {}).retryable
    assert classify_status(RetryPolicy(retry_statuses=[409]), 409, {}).retryable
    assert not classify_status(RetryPolicy(retry_statuses=[503]), 429, {}).retryable


def test_x_should_retry_overrides_the_status_list() -> None:
    assert classify_status(P, 409, {"x-should-retry": "true"}).retryable
    assert not classify_status(P, 503, {"x-should-retry": "false"}).retryable
    assert not classify_status(P, 429, {"x-should-retry": " False "}).retryable
    assert classify_status(P, 503, {"x-should-retry": "maybe"}).retryable


def test_insufficient_quota_is_not_retried() -> None:
    body = parse_error_body(b'{"error": {"message": "quota", "type": "insufficient_quota", "code": null}}')
    verdict = classify_status(P, 429, {}, body)
    assert not verdict.retryable
    assert "insufficient_quota" in verdict.reason
    # openai exposes only the inner error object as exc.body
    assert is_insufficient_quota({"code": "insufficient_quota"})
    # a plain rate limit is still retried
    assert classify_status(P, 429, {}, {"error": {"code": "rate_limit_exceeded"}}).retryable
    # insufficient_quota wins over x-should-retry: true
    assert not classify_status(P, 429, {"x-should-retry": "true"}, body).retryable


#: The shim's answer when its engine cannot be reached, in OpenAI's and in Anthropic's shape.
SHIM_UNAVAILABLE = {
    "error": {
        "message": "upstream unavailable (cannot connect: Connection refused), retry in 1 s",
        "type": "server_overloaded",
        "param": None,
        "code": "upstream_unavailable",
        "retry_after_seconds": 1.0,
        "queue_depth": 0,
    }
}
SHIM_UNAVAILABLE_ANTHROPIC = {
    "type": "error",
    "error": {"type": "overloaded_error", "message": "upstream unavailable", "code": "upstream_unavailable"},
}


@pytest.mark.parametrize(
    ("status", "body", "hint", "unreachable"),
    [
        (503, SHIM_UNAVAILABLE, 1.0, True),
        (503, SHIM_UNAVAILABLE_ANTHROPIC, 1.0, True),
        (503, SHIM_UNAVAILABLE["error"], 1.0, True),  # the inner object alone, as openai's exc.body
        (503, {"error": {"code": "queue_full"}}, 3.0, False),  # busy: waited out
        (503, None, None, False),  # a bare 503 is a busy server too (vLLM's queue limit)
        (429, {"error": {"code": "upstream_unavailable"}}, 1.0, False),  # only the 503 says so
        (502, None, None, True),  # a gateway that reached no one, no plan to be back
        (504, None, None, True),
        (502, None, 5.0, False),  # a hint: a server with a plan, waited out
        (504, {"error": {"code": "x"}}, 0.0, False),
        (500, None, None, False),
    ],
)
def test_which_answers_say_no_one_can_serve_the_call(
    status: int, body: dict[str, object] | None, hint: float | None, unreachable: bool
) -> None:
    assert upstream_unreachable(status, body, hint) is unreachable
    verdict = classify_status(P, status, {}, body, hint=hint)
    assert verdict.retryable
    assert verdict.unreachable is unreachable
    if unreachable:
        assert verdict.reason in ("status 503 upstream_unavailable", f"status {status} without a hint")


def test_an_unreachable_answer_keeps_the_other_rules() -> None:
    # The flag says what the answer means; whether it is retried follows the usual rules.
    refused = classify_status(P, 503, {"x-should-retry": "false"}, SHIM_UNAVAILABLE, hint=1.0)
    assert (refused.retryable, refused.unreachable) == (False, True)
    narrow = RetryPolicy(retry_statuses=[429])
    assert not classify_status(narrow, 503, {}, SHIM_UNAVAILABLE, hint=1.0).retryable
    assert not classify_status(P, 404, {}, SHIM_UNAVAILABLE).unreachable
    assert error_code({"error": {"code": 5}}) == 5
    assert error_code({"error": "text", "code": "c"}) == "c"
    assert error_code(None) is None


def test_parse_error_body_tolerates_junk() -> None:
    assert parse_error_body(b"not json") is None
    assert parse_error_body(b"[1]") is None
    assert parse_error_body(None) is None
    assert parse_error_body(b'{"a": 1}') == {"a": 1}


@pytest.mark.parametrize("lib", ["httpx", "httpx2"])
def test_httpx_family_exceptions(lib: str) -> None:
    mod = pytest.importorskip(lib)
    request = mod.Request("GET", "http://x")
    for cls in (mod.ConnectTimeout, mod.ReadTimeout, mod.WriteTimeout, mod.PoolTimeout):
        assert error_kind(cls("t", request=request)) == "timeout"
    for cls in (mod.ConnectError, mod.ReadError, mod.WriteError, mod.RemoteProtocolError, mod.ProxyError):
        assert error_kind(cls("c", request=request)) == "connection"
    for cls in (mod.UnsupportedProtocol, mod.LocalProtocolError, mod.DecodingError):
        assert error_kind(cls("x", request=request)) is None


def test_openai_exceptions() -> None:
    import openai

    httpx = (
        pytest.importorskip("httpx2") if openai.__version__.startswith("3") else pytest.importorskip("httpx")
    )
    request = httpx.Request("GET", "http://x")
    assert error_kind(openai.APITimeoutError(request=request)) == "timeout"
    assert error_kind(openai.APIConnectionError(request=request)) == "connection"


def test_policy_switches_for_exceptions() -> None:
    timeout = ConnectionResetError("reset")
    assert classify_exception(P, timeout).retryable
    assert not classify_exception(RetryPolicy(retry_connection_errors=False), timeout).retryable
    httpx = pytest.importorskip("httpx")
    read_timeout = httpx.ReadTimeout("slow", request=httpx.Request("GET", "http://x"))
    assert classify_exception(P, read_timeout).retryable
    verdict = classify_exception(RetryPolicy(retry_timeouts=False), read_timeout)
    assert not verdict.retryable
    assert "ReadTimeout" in verdict.reason


def test_our_own_timeout_and_bugs_are_not_retried() -> None:
    assert not classify_exception(P, RateLimitTimeout("limit")).retryable
    assert not classify_exception(P, ValueError("bug")).retryable
    assert not classify_exception(P, TimeoutError("generic")).retryable
