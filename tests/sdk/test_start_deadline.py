"""``RetryPolicy.start_deadline``: a budget for the answer to begin, apart from the whole call's.

Pure checks of the policy and `RetryState`; the transport with mock servers (what it
sends and cuts); and real loopback servers, where the one thing a mock cannot show is
checked: a stream that began before the start deadline is not cut by it afterwards.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import openai
import pytest

import llm_backoff
from llm_backoff.attempts import GiveUp, Retry, RetryState
from llm_backoff.classify import Verdict
from llm_backoff.transport import RetryEngine


def transports(lib: ModuleType) -> tuple[type[Any], type[Any]]:
    from llm_backoff import transport

    if lib.__name__ == "httpx2":
        return transport.Httpx2RetryTransport, transport.AsyncHttpx2RetryTransport
    return transport.HttpxRetryTransport, transport.AsyncHttpxRetryTransport


# -- the policy and the state ------------------------------------------------------------


def test_a_start_deadline_past_the_deadline_is_refused_with_both_named() -> None:
    with pytest.raises(ValueError, match=r"start_deadline \(40\) must be <= deadline \(30\)"):
        llm_backoff.RetryPolicy(deadline=30, start_deadline=40)
    assert llm_backoff.RetryPolicy(deadline=None, start_deadline=5).start_deadline == 5
    with pytest.raises(ValueError, match="start_deadline"):
        llm_backoff.RetryPolicy(start_deadline=0)


def test_time_to_start_is_the_sooner_of_the_two() -> None:
    now = [100.0]
    policy = llm_backoff.RetryPolicy(deadline=30, start_deadline=10)
    state = RetryState(policy, clock=lambda: now[0], rng=random.Random(1))
    now[0] = 104.0
    assert state.time_to_start() == pytest.approx(6.0)
    assert state.time_left() == pytest.approx(26.0)
    only_start = RetryState(
        llm_backoff.RetryPolicy(deadline=None, start_deadline=10), clock=lambda: now[0], rng=random.Random(1)
    )
    assert only_start.time_to_start() == pytest.approx(10.0)
    without = RetryState(llm_backoff.RetryPolicy(deadline=30), clock=lambda: now[0], rng=random.Random(1))
    assert without.starts_by is None
    assert without.time_to_start() == without.time_left()


def test_a_retry_that_would_begin_past_the_start_deadline_gives_up_now() -> None:
    now = [0.0]
    policy = llm_backoff.RetryPolicy(deadline=30, start_deadline=10, retry_after_jitter=0)
    state = RetryState(policy, clock=lambda: now[0], rng=random.Random(1))
    busy = Verdict(True, "status 429")
    first = state.decide(busy, attempt_started=0.0, status=429, hint=4.0)
    assert isinstance(first, Retry)
    assert first.wait == pytest.approx(4.0)
    now[0] = 5.0
    second = state.decide(busy, attempt_started=4.0, status=429, hint=5.0)
    assert isinstance(second, GiveUp)
    assert "would pass the 10 s start deadline" in second.reason
    # The same wait under the whole call's deadline alone would have been taken.
    plain = RetryState(
        llm_backoff.RetryPolicy(deadline=30, retry_after_jitter=0), clock=lambda: now[0], rng=random.Random(1)
    )
    assert isinstance(plain.decide(busy, attempt_started=4.0, status=429, hint=5.0), Retry)


# -- the transport, against mock servers ---------------------------------------------------------


class Recorder:
    """Answers from ``answers`` in turn and keeps each request with a copy of its timeouts."""

    def __init__(self, lib: ModuleType, answers: list[Callable[[], Any]]) -> None:
        self.lib = lib
        self.answers = answers
        self.requests: list[Any] = []
        self.timeouts: list[dict[str, Any]] = []
        self.budgets: list[str] = []  # the request is reused across attempts: keep what each sent

    def __call__(self, request: Any) -> Any:
        self.requests.append(request)
        self.timeouts.append(dict(request.extensions.get("timeout", {})))
        self.budgets.append(request.headers["x-request-timeout-ms"])
        return self.answers[len(self.requests) - 1]()


def test_the_server_is_told_the_start_budget_and_the_wait_for_the_head_is_cut_to_it(
    lib: ModuleType, fake_time: Any
) -> None:
    busy = lambda: lib.Response(429, headers={"retry-after-ms": "1500"}, json={"error": {"message": "busy"}})  # noqa: E731
    server = Recorder(lib, [busy, busy])
    sync_cls, _ = transports(lib)
    policy = llm_backoff.RetryPolicy(deadline=30, start_deadline=2, retry_after_jitter=0)
    engine = RetryEngine(policy, **fake_time.engine_options())
    with lib.Client(transport=sync_cls(lib.MockTransport(server), engine=engine), timeout=60) as client:
        response = client.post("http://engine/v1/chat/completions", json={"model": "m"})
    assert response.status_code == 429
    assert server.budgets == ["2000", "500"]
    assert server.timeouts[0] == dict.fromkeys(("connect", "read", "write", "pool"), 2.0)
    assert "start deadline" in response.extensions["llm_backoff.reason"]
    assert fake_time.sleeps == [1.5]


def test_the_budget_is_sent_as_one_to_begin_only_when_the_start_deadline_binds(
    lib: ModuleType, fake_time: Any
) -> None:
    sync_cls, _ = transports(lib)
    scopes = []
    for policy in (
        llm_backoff.RetryPolicy(deadline=30, start_deadline=2),
        llm_backoff.RetryPolicy(deadline=None, start_deadline=2),
        llm_backoff.RetryPolicy(deadline=30, start_deadline=30),  # the deadline binds as soon
        llm_backoff.RetryPolicy(deadline=30),
    ):
        server = Recorder(lib, [lambda: lib.Response(200, json={})])
        engine = RetryEngine(policy, **fake_time.engine_options())
        with lib.Client(transport=sync_cls(lib.MockTransport(server), engine=engine), timeout=60) as client:
            client.post("http://engine/v1/chat/completions", json={"model": "m"})
        scopes.append(server.requests[0].headers.get("x-request-timeout-scope"))
    assert scopes == ["start", "start", None, None]


def test_a_stream_that_began_reads_its_body_under_the_whole_deadline(lib: ModuleType, fake_time: Any) -> None:
    def events() -> Any:
        return lib.Response(
            200, headers={"content-type": "text/event-stream"}, stream=lib.ByteStream(b"data: x\n\n")
        )

    server = Recorder(lib, [events])
    sync_cls, _ = transports(lib)
    policy = llm_backoff.RetryPolicy(deadline=30, start_deadline=2)
    engine = RetryEngine(policy, **fake_time.engine_options())
    with lib.Client(transport=sync_cls(lib.MockTransport(server), engine=engine), timeout=60) as client:
        request = client.build_request("POST", "http://engine/v1/chat/completions", json={"stream": True})
        response = client.send(request, stream=True)
        response.close()
    assert server.timeouts[0]["read"] == 2.0  # while the head was awaited
    assert server.requests[0].extensions["timeout"]["read"] == 30.0  # once the answer began


# -- real loopback servers -----------------------------------------------------------------------

_CHUNK = (
    b'data: {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m", '
    b'"choices": [{"index": 0, "delta": {"content": "%d"}, "finish_reason": null}]}\n\n'
)


class LoopbackApp:
    """``/v1/chat/completions``: an event stream with a pause mid-way, or a head held back.

    A held head is sent only once the test sets ``release`` (or after 5 s): a call that
    waited for it instead of giving up at its start deadline would then succeed.
    """

    def __init__(self, *, hold_head: bool = False, pause: float = 0.0) -> None:
        self.hold_head = hold_head
        self.release = threading.Event()
        self.pause = pause
        self.budgets: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        headers = dict(scope["headers"])
        self.budgets.append(headers.get(b"x-request-timeout-ms", b"").decode())
        while (await receive()).get("more_body"):
            pass
        for _ in range(500):
            if not self.hold_head or self.release.is_set():
                break
            await asyncio.sleep(0.01)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": _CHUNK % 1, "more_body": True})
        await asyncio.sleep(self.pause)
        await send({"type": "http.response.body", "body": _CHUNK % 2, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _policy() -> llm_backoff.RetryPolicy:
    # 1 s to begin: ample for a loopback head on a loaded machine; the streams pause for longer.
    return llm_backoff.RetryPolicy(deadline=10, start_deadline=1.0)


def _contents(chunks: list[Any]) -> list[str]:
    return [c.choices[0].delta.content for c in chunks]


def test_openai_stream_paused_longer_than_the_start_budget_is_not_cut(serve: Callable[[Any], str]) -> None:
    app = LoopbackApp(pause=1.5)
    url = serve(app)
    client = llm_backoff.wrap(openai.OpenAI(base_url=url + "/v1", api_key="k"), _policy())
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert _contents(list(stream)) == ["1", "2"]
    assert 0 < int(app.budgets[0]) <= 1000


async def test_async_openai_stream_paused_longer_than_the_start_budget_is_not_cut(
    serve: Callable[[Any], str],
) -> None:
    app = LoopbackApp(pause=1.5)
    url = serve(app)
    client = llm_backoff.wrap(openai.AsyncOpenAI(base_url=url + "/v1", api_key="k"), _policy())
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert _contents([chunk async for chunk in stream]) == ["1", "2"]


def _check_cut(exc: BaseException, app: LoopbackApp) -> None:
    app.release.set()
    assert isinstance(exc, openai.APITimeoutError)
    attempts = exc.llm_backoff_attempts  # type: ignore[attr-defined]
    assert len(attempts) == 1
    assert len(app.budgets) == 1
    assert 0 < int(app.budgets[0]) <= 1000
    assert "start deadline" in "\n".join(getattr(exc, "__notes__", []))


def test_openai_head_later_than_the_start_deadline_is_cut_and_not_retried(
    serve: Callable[[Any], str],
) -> None:
    app = LoopbackApp(hold_head=True)
    url = serve(app)
    client = llm_backoff.wrap(openai.OpenAI(base_url=url + "/v1", api_key="k"), _policy())
    with pytest.raises(openai.APITimeoutError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    _check_cut(caught.value, app)


async def test_async_openai_head_later_than_the_start_deadline_is_cut_and_not_retried(
    serve: Callable[[Any], str],
) -> None:
    app = LoopbackApp(hold_head=True)
    url = serve(app)
    client = llm_backoff.wrap(openai.AsyncOpenAI(base_url=url + "/v1", api_key="k"), _policy())
    with pytest.raises(openai.APITimeoutError) as caught:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    _check_cut(caught.value, app)
