"""Pure wire helpers: hop-by-hop stripping, the rejection response, the budget header."""

from __future__ import annotations

import json

import pytest

from llm_backoff_shim.decide.tickets import Rejection
from llm_backoff_shim.serve.api.rejection import (
    Refusal,
    client_error,
    in_shape,
    rejection_response,
    retry_after_header,
    server_error,
)
from llm_backoff_shim.serve.api.routes import Shape
from llm_backoff_shim.serve.request_path.headers import strip_hop_by_hop
from llm_backoff_shim.serve.request_path.intake import parse_budget, parse_request_start, waited_since
from llm_backoff_shim.serve.request_path.proxy import is_generation


def test_strips_rfc9110_hop_by_hop_and_connection_named_headers() -> None:
    headers = [
        (b"connection", b"keep-alive, X-Session-Hop"),
        (b"x-session-hop", b"1"),
        (b"keep-alive", b"timeout=5"),
        (b"transfer-encoding", b"chunked"),
        (b"upgrade", b"h2c"),
        (b"te", b"trailers"),
        (b"proxy-authorization", b"Basic x"),
        (b"authorization", b"Bearer sk"),
        (b"content-type", b"application/json"),
        (b"x-b", b"2"),
        (b"x-a", b"1"),
    ]
    kept = strip_hop_by_hop(headers)
    assert kept == [
        (b"authorization", b"Bearer sk"),
        (b"content-type", b"application/json"),
        (b"x-b", b"2"),
        (b"x-a", b"1"),
    ]


def test_request_side_also_drops_host_and_length() -> None:
    headers = [
        (b"host", b"shim:8080"),
        (b"content-length", b"12"),
        (b"expect", b"100-continue"),
        (b"x", b"y"),
    ]
    assert strip_hop_by_hop(headers, request=True) == [(b"x", b"y")]
    assert strip_hop_by_hop(headers) == headers


def test_upstream_names_come_back_lowercased_and_connection_named_fields_dropped() -> None:
    headers = [
        (b"Content-Type", b"text/event-stream"),
        (b"Connection", b"keep-alive, X-Hop"),
        (b"X-Hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Request-Id", b"abc"),
    ]
    assert strip_hop_by_hop(headers, lower=True) == [
        (b"content-type", b"text/event-stream"),
        (b"x-request-id", b"abc"),
    ]
    assert strip_hop_by_hop(headers) == [(b"Content-Type", b"text/event-stream"), (b"X-Request-Id", b"abc")]


@pytest.mark.parametrize(
    ("seconds", "header"), [(0.0, 1), (0.2, 1), (1.0, 1), (1.001, 2), (2.75, 3), (30.0, 30)]
)
def test_retry_after_header_is_whole_seconds_at_least_one_never_early(seconds: float, header: int) -> None:
    assert retry_after_header(seconds) == header


def test_rejection_response_matches_the_design_protocol() -> None:
    response = rejection_response(
        Rejection(code="queue_full", message="server at capacity", retry_after=2.75, queue_depth=17), 429
    )
    assert response.status == 429
    headers = dict(response.headers)
    assert headers[b"retry-after"] == b"3"
    assert headers[b"retry-after-ms"] == b"2750"
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(response.body)
    assert json.loads(response.body) == {
        "error": {
            "message": "server at capacity, retry in 3 s",
            "type": "server_overloaded",
            "param": None,
            "code": "queue_full",
            "retry_after_seconds": 2.75,
            "queue_depth": 17,
        }
    }


def test_rejection_status_override_and_type() -> None:
    rejection = Rejection(
        code="tenant_rate_limited",
        message="quota",
        retry_after=4.0,
        queue_depth=0,
        type="rate_limit_exceeded",
        status=503,
    )
    response = rejection_response(rejection, 429)
    assert response.status == 503
    assert json.loads(response.body)["error"]["type"] == "rate_limit_exceeded"


def test_client_error_shape() -> None:
    response = client_error("bad", param="x-request-class", code="invalid_request_class")
    assert response.status == 400
    assert json.loads(response.body) == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "x-request-class",
            "code": "invalid_request_class",
        }
    }


def test_parse_budget() -> None:
    assert parse_budget(None) is None
    assert parse_budget(" ") is None
    assert parse_budget("8000") == 8.0
    assert parse_budget("12.5") == 0.0125
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(ValueError):  # noqa: PT011 - float() and our own check differ in message
            parse_budget(bad)


def test_parse_request_start_reads_each_load_balancers_form() -> None:
    assert parse_request_start("t=1733352000.123") == pytest.approx(1733352000.123)  # nginx $msec
    assert parse_request_start("t=1733352000123") == pytest.approx(1733352000.123)  # HAProxy, ms
    assert parse_request_start("t=1733352000123456") == pytest.approx(1733352000.123456)  # microseconds
    assert parse_request_start(" 1733352000 ") == 1733352000.0  # no t=
    for ignored in (None, "", "t=", "soon", "t=-5", "t=0", "t=nan", "t=inf", "t=1e400"):
        assert parse_request_start(ignored) is None


def test_waited_since_counts_only_a_plausible_stamp() -> None:
    now = 1_000_000.0
    assert waited_since(None, now) == 0.0
    assert waited_since(now - 4.5, now) == 4.5
    assert waited_since(now + 0.5, now) == 0.0  # a little ahead: the clocks differ
    assert waited_since(now + 5.0, now) == 0.0  # far ahead: not a stamp of this call
    assert waited_since(now - 7200.0, now) == 0.0  # hours old: not a call in progress


def test_generation_endpoints() -> None:
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/completions/",
    ):
        assert is_generation("POST", path)
    assert not is_generation("GET", "/v1/chat/completions")
    assert not is_generation("POST", "/v1/models")
    assert not is_generation("GET", "/v1/responses/resp_123")


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        # Refusals for load or quota: worth retrying whatever status the operator chose.
        (
            rejection_response(Rejection(code="queue_full", message="m", retry_after=1.0), 429),
            b"retry-queue-full",
        ),
        (
            rejection_response(Rejection(code="slo_shed", message="m", retry_after=1.0), 503),
            b"retry-slo-shed",
        ),
        (
            rejection_response(Rejection(code="tenant_rate_limited", message="m", retry_after=9.0), 429),
            b"retry-tenant-rate-limited",
        ),
        (
            rejection_response(
                Rejection(code="upstream_unavailable", message="m", retry_after=1.0, status=503), 429
            ),
            b"retry-upstream-unavailable",
        ),
        # About the request itself: the same request cannot succeed.
        (client_error("m", code="class_not_allowed", status=403), b"final-class-not-allowed"),
        (client_error("m", code="invalid_json"), b"final-invalid-json"),
        (client_error("m", code="request_too_large", status=413), b"final-request-too-large"),
        (client_error("no such path", status=404), b"final-status-404"),
        # A client too slow to send its body may do better next time.
        (client_error("m", code="body_timeout", status=408), b"retry-body-timeout"),
        (server_error("m", code="bad_upstream_response"), b"retry-bad-upstream-response"),
    ],
)
def test_every_answer_the_shim_makes_says_whether_a_retry_can_succeed(answer: Refusal, reason: bytes) -> None:
    assert [v for k, v in answer.headers if k == b"x-llm-backoff-refusal"] == [reason]


def test_the_refusal_reason_survives_the_anthropic_shape() -> None:
    refusal = rejection_response(Rejection(code="queue_full", message="m", retry_after=1.0), 429)
    shaped = in_shape(refusal, Shape.ANTHROPIC)
    assert shaped.status == 529
    assert dict(shaped.headers)[b"x-llm-backoff-refusal"] == b"retry-queue-full"
