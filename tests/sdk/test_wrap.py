"""wrap() over openai clients with mock transports: what is kept, what changes, what is raised.

Runs on openai 3.x (httpx2 and legacy httpx http clients) and openai 2.x (httpx).
"""

from __future__ import annotations

import asyncio
import json
import time
from types import ModuleType
from typing import Any

import openai
import pytest

import llm_backoff
from llm_backoff import RetryEvent, RetryPolicy, UnsupportedClientError
from llm_backoff.testing import instant_retries

OPENAI3 = openai.__version__.startswith("3.")


@pytest.fixture
def http(lib: ModuleType) -> ModuleType:
    if lib.__name__ == "httpx2" and not OPENAI3:
        pytest.skip("openai 2.x takes httpx clients only")
    return lib


def models_page() -> dict[str, Any]:
    return {"object": "list", "data": [{"id": "m1", "object": "model", "created": 0, "owned_by": "me"}]}


def completion(text: str = "hi") -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


class Script:
    """A mock server handler: answers from a list, records what it saw."""

    def __init__(self, http: ModuleType, *answers: Any) -> None:
        self.http = http
        self.answers = list(answers)
        self.requests: list[Any] = []
        self.headers: list[dict[str, str]] = []

    def __call__(self, request: Any) -> Any:
        self.requests.append(request)
        self.headers.append(dict(request.headers))
        answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
        if isinstance(answer, type) and issubclass(answer, Exception):
            raise answer("scripted", request=request)
        if callable(answer):
            return answer(request)
        status, body, *rest = answer
        headers = rest[0] if rest else {}
        return self.http.Response(status, json=body, headers=headers)


def rate_limited(after: str = "1") -> tuple[int, dict[str, Any], dict[str, str]]:
    return (
        429,
        {"error": {"message": "slow down", "type": "server_overloaded", "code": "queue_full"}},
        {"retry-after": after},
    )


def make_client(http: ModuleType, script: Script, *, is_async: bool = False, **kw: Any) -> Any:
    if is_async:
        return openai.AsyncOpenAI(
            api_key="sk-test",
            base_url="http://llm.test/v1",
            http_client=http.AsyncClient(transport=http.MockTransport(script)),
            **kw,
        )
    return openai.OpenAI(
        api_key="sk-test",
        base_url="http://llm.test/v1",
        http_client=http.Client(transport=http.MockTransport(script)),
        **kw,
    )


def test_returns_same_class_and_leaves_the_original_untouched(http: ModuleType) -> None:
    script = Script(http, (200, models_page()))
    original = make_client(http, script, max_retries=4)
    original_http = original._client
    wrapped = llm_backoff.wrap(original)
    assert type(wrapped) is type(original)
    assert wrapped is not original
    assert wrapped.max_retries == 0
    assert original.max_retries == 4
    assert original._client is original_http
    assert original_http._transport.__class__.__name__ == "MockTransport"
    assert "request" not in vars(original)
    wrapped.models.list()
    wrapped.close()
    assert original.models.list().data[0].id == "m1"  # the given client stays usable


def test_caller_settings_are_kept(http: ModuleType) -> None:
    script = Script(http, (200, models_page()))
    hooked: list[str] = []
    http_client = http.Client(
        transport=http.MockTransport(script),
        headers={"x-team": "search"},
        event_hooks={"request": [lambda request: hooked.append(str(request.url))]},
    )
    original = openai.OpenAI(
        api_key="sk-secret",
        base_url="http://llm.test/v1",
        http_client=http_client,
        default_headers={"x-app": "demo"},
        timeout=12.5,
        organization="org-1",
    )
    wrapped = llm_backoff.wrap(original, request_class="batch")
    assert str(wrapped.base_url) == "http://llm.test/v1/"
    assert wrapped.api_key == "sk-secret"
    assert wrapped.timeout == 12.5
    wrapped.models.list()
    sent = script.headers[0]
    assert sent["authorization"] == "Bearer sk-secret"
    assert sent["x-team"] == "search"
    assert sent["x-app"] == "demo"
    assert sent["openai-organization"] == "org-1"
    assert sent["x-request-class"] == "batch"
    assert 0 < int(sent["x-request-timeout-ms"]) <= 60_000
    assert hooked == ["http://llm.test/v1/models"]
    # headers were copied, not shared
    wrapped._client.headers["x-team"] = "changed"
    assert http_client.headers["x-team"] == "search"


def test_sdk_retries_are_off_so_attempts_do_not_multiply(http: ModuleType) -> None:
    script = Script(http, rate_limited())
    wrapped = llm_backoff.wrap(make_client(http, script, max_retries=5), RetryPolicy(max_attempts=3))
    with instant_retries(), pytest.raises(openai.RateLimitError):
        wrapped.models.list()
    assert len(script.requests) == 3
    # openai's own loop made one call (its count stays 0); the retries are ours, counted on top
    assert [h["x-stainless-retry-count"] for h in script.headers] == ["0", "1", "2"]


def test_rate_limit_error_keeps_its_type_and_carries_the_history(http: ModuleType) -> None:
    script = Script(http, rate_limited("2"))
    wrapped = llm_backoff.wrap(make_client(http, script), RetryPolicy(max_attempts=2))
    with instant_retries(), pytest.raises(openai.RateLimitError) as info:
        wrapped.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    exc = info.value
    assert exc.status_code == 429
    assert exc.body["code"] == "queue_full"  # type: ignore[index]
    attempts = exc.llm_backoff_attempts  # type: ignore[attr-defined]
    assert [(a.number, a.status, a.hint) for a in attempts] == [(1, 429, 2.0), (2, 429, 2.0)]
    assert all(isinstance(a, llm_backoff.Attempt) for a in attempts)
    note = "\n".join(exc.__notes__)
    assert "2 attempts" in note
    assert "max_attempts (2)" in note
    # the request body was sent identically both times
    assert script.requests[0].content == script.requests[1].content
    assert json.loads(script.requests[0].content)["messages"][0]["content"] == "hi"


@pytest.mark.parametrize(
    ("failure", "expected"),
    [("ConnectError", openai.APIConnectionError), ("ReadTimeout", openai.APITimeoutError)],
)
def test_transport_failures_become_openai_errors_with_history(
    http: ModuleType, failure: str, expected: type[Exception]
) -> None:
    script = Script(http, getattr(http, failure))
    wrapped = llm_backoff.wrap(make_client(http, script), RetryPolicy(max_attempts=3))
    with instant_retries(), pytest.raises(expected) as info:
        wrapped.embeddings.create(model="e", input="text")
    assert type(info.value) is expected
    attempts = info.value.llm_backoff_attempts  # type: ignore[attr-defined]
    assert [a.error for a in attempts] == [f"{failure}: scripted"] * 3
    assert len(script.requests) == 3


def test_bad_request_is_raised_at_once_with_a_one_attempt_history(http: ModuleType) -> None:
    script = Script(http, (400, {"error": {"message": "bad model", "type": "invalid_request_error"}}))
    wrapped = llm_backoff.wrap(make_client(http, script))
    with pytest.raises(openai.BadRequestError) as info:
        wrapped.models.list()
    assert len(info.value.llm_backoff_attempts) == 1  # type: ignore[attr-defined]
    assert len(script.requests) == 1


def test_hook_and_late_subscription(http: ModuleType) -> None:
    script = Script(http, rate_limited("0.5"), (200, models_page()))
    early: list[RetryEvent] = []
    late: list[RetryEvent] = []
    wrapped = llm_backoff.wrap(make_client(http, script), on_retry=early.append)
    llm_backoff.retry_observers(wrapped).subscribe(late.append)
    with instant_retries():
        wrapped.models.list()
    assert [(e.attempt, e.reason, e.hint) for e in early] == [(1, "status 429", 0.5)]
    assert late == early
    assert 0.5 <= early[0].wait <= 0.6
    with pytest.raises(UnsupportedClientError):
        llm_backoff.retry_observers(make_client(http, script))


def test_with_options_and_copy_keep_retrying_and_annotating(http: ModuleType) -> None:
    script = Script(http, rate_limited())
    wrapped = llm_backoff.wrap(make_client(http, script), RetryPolicy(max_attempts=2))
    derived = wrapped.with_options(timeout=5)
    assert type(derived) is type(wrapped)
    assert derived.max_retries == 0
    with instant_retries(), pytest.raises(openai.RateLimitError) as info:
        derived.models.list()
    assert len(info.value.llm_backoff_attempts) == 2  # type: ignore[attr-defined]
    assert len(script.requests) == 2


def test_wrapping_twice_replaces_the_policy_instead_of_nesting(http: ModuleType) -> None:
    script = Script(http, rate_limited())
    once = llm_backoff.wrap(make_client(http, script), RetryPolicy(max_attempts=3))
    twice = llm_backoff.wrap(once, RetryPolicy(max_attempts=2))
    with instant_retries(), pytest.raises(openai.RateLimitError):
        twice.models.list()
    assert len(script.requests) == 2


def test_pagination_requests_are_retried(http: ModuleType) -> None:
    def page(items: list[str], more: bool) -> dict[str, Any]:
        data = [
            {
                "id": i,
                "object": "file",
                "bytes": 1,
                "created_at": 0,
                "filename": i,
                "purpose": "batch",
                "status": "processed",
            }
            for i in items
        ]
        return {"object": "list", "data": data, "has_more": more}

    script = Script(http, (200, page(["f1", "f2"], True)), rate_limited(), (200, page(["f3"], False)))
    wrapped = llm_backoff.wrap(make_client(http, script))
    with instant_retries():
        ids = [f.id for f in wrapped.files.list()]
    assert ids == ["f1", "f2", "f3"]
    assert len(script.requests) == 3
    assert script.requests[2].url.params["after"] == "f2"


def sse_body(*texts: str) -> bytes:
    events = []
    for t in texts:
        chunk = {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}],
        }
        events.append(f"data: {json.dumps(chunk)}\n\n")
    events.append("data: [DONE]\n\n")
    return "".join(events).encode()


def test_streaming_is_retried_before_it_starts(http: ModuleType) -> None:
    def stream(_: Any) -> Any:
        return http.Response(200, headers={"content-type": "text/event-stream"}, content=sse_body("a", "b"))

    script = Script(http, rate_limited(), stream)
    wrapped = llm_backoff.wrap(make_client(http, script))
    with instant_retries():
        chunks = wrapped.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "ab"
    assert len(script.requests) == 2


def test_rejects_what_it_cannot_wrap(http: ModuleType) -> None:
    with pytest.raises(UnsupportedClientError, match=r"openai\.OpenAI"):
        llm_backoff.wrap(object())  # type: ignore[type-var]
    script = Script(http, (200, models_page()))
    with pytest.raises(TypeError, match="RetryPolicy"):
        llm_backoff.wrap(make_client(http, script), {"max_attempts": 2})  # type: ignore[arg-type]
    closed = make_client(http, script)
    closed.close()
    with pytest.raises(UnsupportedClientError, match="closed"):
        llm_backoff.wrap(closed)


# -- async ---------------------------------------------------------------------------


async def test_async_client_is_wrapped_the_same_way(http: ModuleType) -> None:
    script = Script(http, rate_limited("1"), (200, completion("yes")), (200, models_page()))
    original = make_client(http, script, is_async=True)
    wrapped = llm_backoff.wrap(original, request_class="interactive")
    assert type(wrapped) is type(original)
    with instant_retries():
        result = await wrapped.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    assert result.choices[0].message.content == "yes"
    assert [h["x-request-class"] for h in script.headers] == ["interactive"] * 2
    await wrapped.close()
    page = await original.models.list()  # the given client stays usable
    assert [m.id for m in page.data] == ["m1"]


async def test_async_errors_carry_history(http: ModuleType) -> None:
    script = Script(http, rate_limited("1"))
    wrapped = llm_backoff.wrap(make_client(http, script, is_async=True), RetryPolicy(max_attempts=2))
    with instant_retries(), pytest.raises(openai.RateLimitError) as info:
        await wrapped.models.list()
    assert len(info.value.llm_backoff_attempts) == 2  # type: ignore[attr-defined]


async def test_async_streaming_and_pagination(http: ModuleType) -> None:
    def stream(_: Any) -> Any:
        return http.Response(200, headers={"content-type": "text/event-stream"}, content=sse_body("x", "y"))

    script = Script(http, rate_limited(), stream, (503, {}), (200, models_page()))
    wrapped = llm_backoff.wrap(make_client(http, script, is_async=True))
    with instant_retries():
        chunks = await wrapped.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in chunks])
        models = [m.id async for m in wrapped.models.list()]
    assert text == "xy"
    assert models == ["m1"]
    assert len(script.requests) == 4


class _Permit:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def settle(self, *, status: int | None, body: bytes | None) -> None:
        self.log.append(("settle", status))


class _Limiter:
    """Grants ``grants`` permits, then reports that the deadline would pass."""

    def __init__(self, grants: int) -> None:
        self.grants = grants
        self.log: list[Any] = []

    def acquire_for(self, request: Any, *, timeout: float | None) -> _Permit:
        if self.grants <= 0:
            raise llm_backoff.RateLimitTimeout(f"no capacity within {timeout:.1f} s")
        self.grants -= 1
        self.log.append(("acquire", request.method))
        return _Permit(self.log)

    async def acquire_for_async(self, request: Any, *, timeout: float | None) -> _Permit:
        return self.acquire_for(request, timeout=timeout)


class _Budget:
    def __init__(self) -> None:
        self.requests = 0
        self.spent = 0

    def record_request(self) -> None:
        self.requests += 1

    def try_spend(self) -> bool:
        self.spent += 1
        return True


def test_limiter_and_budget_are_plumbed_through(http: ModuleType) -> None:
    script = Script(http, rate_limited(), (200, models_page()))
    limiter, budget = _Limiter(grants=3), _Budget()
    wrapped = llm_backoff.wrap(make_client(http, script), limiter=limiter, budget=budget)
    with instant_retries():
        wrapped.models.list()
    assert limiter.log == [("acquire", "GET"), ("settle", 429), ("acquire", "GET"), ("settle", 200)]
    assert (budget.requests, budget.spent) == (1, 1)
    # the next call gets the last permit, is rejected, and cannot get another one in time
    script.answers = [rate_limited()]
    with instant_retries(), pytest.raises(llm_backoff.RateLimitTimeout, match="no capacity") as info:
        wrapped.models.list()
    assert [a.status for a in info.value.llm_backoff_attempts] == [429]  # type: ignore[attr-defined]


async def test_async_limiter_timeout_is_raised_typed(http: ModuleType) -> None:
    script = Script(http, (200, models_page()))
    wrapped = llm_backoff.wrap(make_client(http, script, is_async=True), limiter=_Limiter(grants=0))
    with pytest.raises(llm_backoff.RateLimitTimeout):
        await wrapped.models.list()
    assert script.requests == []


def test_the_deadline_counts_from_the_call_not_from_when_the_transport_sees_it(http: ModuleType) -> None:
    # The openai client's own work before its transport (here a request hook that takes
    # 0.3 s) is part of the caller's time: the budget sent to the server must say so.
    script = Script(http, (200, completion()))
    http_client = http.Client(
        transport=http.MockTransport(script), event_hooks={"request": [lambda request: time.sleep(0.3)]}
    )
    original = openai.OpenAI(api_key="k", base_url="http://llm.test/v1", http_client=http_client)
    wrapped = llm_backoff.wrap(original, RetryPolicy(deadline=2.0))
    wrapped.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert int(script.headers[0]["x-request-timeout-ms"]) <= 1_700


async def test_async_calls_count_their_deadline_from_the_call_too(http: ModuleType) -> None:
    script = Script(http, (200, completion()))

    async def slow_hook(request: Any) -> None:
        await asyncio.sleep(0.3)

    http_client = http.AsyncClient(transport=http.MockTransport(script), event_hooks={"request": [slow_hook]})
    original = openai.AsyncOpenAI(api_key="k", base_url="http://llm.test/v1", http_client=http_client)
    wrapped = llm_backoff.wrap(original, RetryPolicy(deadline=2.0))
    await wrapped.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    # A second call starts its own deadline: the mark of the first is not left behind.
    await wrapped.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    budgets = [int(headers["x-request-timeout-ms"]) for headers in script.headers]
    assert all(budget <= 1_700 for budget in budgets)
    assert all(budget >= 1_000 for budget in budgets)
