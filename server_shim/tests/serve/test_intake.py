"""Intake.head and Intake.body: the checks on a request in one order, without a server."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.serve.api.auth import ApiKeys
from llm_backoff_shim.serve.api.rejection import Refusal
from llm_backoff_shim.serve.api.routes import RouteTable, Shape
from llm_backoff_shim.serve.policy.request_hooks import RequestHooks
from llm_backoff_shim.serve.request_path.intake import Head, Intake
from llm_backoff_shim.testing import ManualClock

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller

KEY = "sk-intake-test"
CHAT = "/v1/chat/completions"


@pytest.fixture
def intake(make_controller: MakeController) -> Intake:
    controller, _ = make_controller()
    return Intake(
        routes=RouteTable(),
        api_keys=ApiKeys([KEY]),
        hooks=RequestHooks(),
        controller=controller,
        max_body_bytes=100,
    )


def headers(*extra: tuple[bytes, bytes], key: str | None = KEY) -> list[tuple[bytes, bytes]]:
    auth = [(b"authorization", b"Bearer " + key.encode())] if key is not None else []
    return [*auth, (b"content-type", b"application/json"), *extra]


def refused(answer: Head | Refusal) -> Refusal:
    assert isinstance(answer, Refusal), answer
    return answer


@pytest.mark.parametrize(
    ("path", "head", "reason", "status", "shape"),
    [
        # Each check wins over every later one: path, operator route, key, class, budget,
        # content type, declared size.
        ("/nowhere", headers((b"x-request-class", b"vip"), key=None), "bad_path", 404, Shape.OPENAI),
        ("/v1/load_lora_adapter", headers(key=None), "operator_route", 403, Shape.OPENAI),
        (
            "/v1/messages",
            headers((b"x-request-class", b"vip"), key="wrong"),
            "unauthorized",
            401,
            Shape.ANTHROPIC,
        ),
        (
            CHAT,
            headers((b"x-request-class", b"vip"), (b"x-request-timeout-ms", b"-1")),
            "invalid_request_class",
            400,
            Shape.OPENAI,
        ),
        (
            CHAT,
            headers((b"x-request-timeout-ms", b"soon"), (b"content-length", b"999")),
            "invalid_header",
            400,
            Shape.OPENAI,
        ),
        (
            CHAT,
            [
                (b"authorization", b"Bearer " + KEY.encode()),
                (b"content-type", b"text/plain"),
                (b"content-length", b"999"),
            ],
            "unsupported_media_type",
            415,
            Shape.OPENAI,
        ),
        (CHAT, headers((b"content-length", b"999")), "body_too_large", 413, Shape.OPENAI),
    ],
)
def test_the_head_is_checked_in_one_order(
    intake: Intake, path: str, head: list[tuple[bytes, bytes]], reason: str, status: int, shape: Shape
) -> None:
    refusal = refused(intake.head("POST", path, head))
    assert (refusal.reason, refusal.status, refusal.shape) == (reason, status, shape)


def test_only_a_post_to_an_engine_route_becomes_an_admission_request(intake: Intake) -> None:
    posted = intake.head("POST", CHAT, headers((b"x-request-timeout-ms", b"2500")))
    assert isinstance(posted, Head)
    assert posted.request is not None
    assert (posted.request.cls, posted.request.budget) == ("interactive", 2.5)
    # Class headers are not read off the admission path: a GET there is forwarded as it is.
    fetched = intake.head("GET", CHAT, headers((b"x-request-class", b"vip")))
    assert isinstance(fetched, Head)
    assert fetched.request is None


def test_the_body_says_what_the_admission_request_asks_for(intake: Intake) -> None:
    head = intake.head("POST", CHAT, headers())
    assert isinstance(head, Head)
    checked = intake.body(head, b'{"stream": true, "max_tokens": 64}')
    assert not isinstance(checked, Refusal)
    request, data = checked
    assert request is not None
    assert (request.stream, request.max_tokens) == (True, 64)
    assert data == {"stream": True, "max_tokens": 64}
    malformed = refused(intake.body(head, b"[1, 2]"))
    assert (malformed.reason, malformed.status) == ("invalid_json", 400)


def test_under_a_cost_budget_the_body_prices_the_request(make_controller: MakeController) -> None:
    controller, _ = make_controller(token_budget=10_000)
    intake = Intake(
        routes=RouteTable(),
        api_keys=ApiKeys([KEY]),
        hooks=RequestHooks(),
        controller=controller,
        max_body_bytes=1000,
    )
    head = intake.head("POST", CHAT, headers())
    assert isinstance(head, Head)
    # 40 bytes of text: 10 tokens, 4 for the message; no max_tokens and no answers learned yet:
    # a slot's share of the budget (decide/pricing.py), never the absent max_tokens.
    assert controller.pricing is not None
    share = controller.pricing.share()
    assert share > 14
    body = b'{"messages": [{"role": "user", "content": "' + b"w" * 40 + b'"}]}'
    checked = intake.body(head, body)
    assert not isinstance(checked, Refusal)
    request, _ = checked
    assert request is not None
    assert (request.cost, request.max_tokens, request.stream) == (share, None, False)
    # With max_tokens 5: its prompt and its whole answer, less than a share.
    checked = intake.body(head, body[:-1] + b', "max_tokens": 5}')
    assert not isinstance(checked, Refusal)
    request, _ = checked
    assert request is not None
    assert (request.cost, request.max_tokens) == (14 + 5, 5)


def test_without_a_cost_budget_the_body_is_not_priced(intake: Intake) -> None:
    head = intake.head("POST", CHAT, headers())
    assert isinstance(head, Head)
    checked = intake.body(head, b'{"prompt": "' + b"w" * 40 + b'", "max_tokens": 5}')
    assert not isinstance(checked, Refusal)
    request, _ = checked
    assert request is not None
    assert (request.cost, request.max_tokens) == (0, 5)
