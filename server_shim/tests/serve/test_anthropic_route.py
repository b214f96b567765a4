"""The real ``anthropic`` SDK against the shim's ``/v1/messages`` in front of the simulator.

The simulator serves Anthropic's Messages API on the same engine slots as chat completions
(sim_anthropic.py). The shim admits ``/v1/messages`` like any engine route and answers its
own refusals in Anthropic's error shape (rejection.py), so the SDK's own retries ride them
out and, with retries off, it raises its typed errors with the hint in the headers.

A slot is held by a stream that the test opens and later closes, never by a sleep; the
retries are counted from the shim's metrics.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest

from llm_backoff_shim.decide.tickets import Rejection
from llm_backoff_shim.serve.api.rejection import client_error, in_shape, rejection_response
from llm_backoff_shim.serve.api.routes import Shape
from llm_backoff_shim.serve.config.tuning import Tuning
from llm_backoff_shim.serve.serving import ServerThread, free_socket
from llm_backoff_shim.sim.runtime import SimRuntime
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

HELLO = [{"role": "user", "content": "Say hello."}]
#: Hints short enough that riding out a refusal costs the test little (clamped: no estimate noise).
FAST_HINTS = {"retry_after_min": 0.05, "retry_after_max": 0.05}
IDLE = {"interactive": (0, 0), "batch": (0, 0)}


class Sim:
    def __init__(self, server: ServerThread, runtime: SimRuntime) -> None:
        self.server = server
        self.runtime = runtime

    @property
    def url(self) -> str:
        return self.server.url

    def busy(self) -> int:
        """Sequences the engine holds (running or waiting) and handlers still open."""
        engine = self.runtime.engine
        return engine.num_running + engine.num_waiting + self.runtime.open_tickets


@pytest.fixture
def make_sim() -> Iterator[Callable[..., Sim]]:
    servers: list[ServerThread] = []

    def factory(**values: Any) -> Sim:
        app = create_sim_app(SimConfig(**{"ttft": 0.001, "itl": 0.001, "output_tokens": 5, **values}))
        server = ServerThread(app).start()
        servers.append(server)
        return Sim(server, app.state.sim)

    yield factory
    for server in servers:
        server.stop()


def _outcomes(shim: Any) -> dict[str, float]:
    """``requests_total`` of class interactive by outcome, summed over codes."""
    totals: dict[str, float] = {}
    for (name, labels), value in shim.metrics().items():
        labels = dict(labels)
        if name == "llm_backoff_shim_requests_total" and labels["class"] == "interactive" and value:
            totals[labels["outcome"]] = totals.get(labels["outcome"], 0) + value
    return totals


def _settled(shim: Any, sim: Sim, waiter: Callable[..., None]) -> None:
    waiter(lambda: shim.state() == IDLE and sim.busy() == 0, what="every slot back")


def test_create_and_stream_through_the_shim(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    sim = make_sim()
    shim = make_shim(sim.url)
    client = anthropic.Anthropic(base_url=shim.url, api_key="unused", max_retries=0)

    message = client.messages.create(model="sim-model", max_tokens=100, messages=HELLO)
    assert message.content[0].type == "text"
    assert message.content[0].text == "token0 token1 token2 token3 token4"
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 5

    with client.messages.stream(model="sim-model", max_tokens=3, messages=HELLO) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert pieces == ["token0", " token1", " token2"]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 3

    events = [e.type for e in client.messages.create(model="m", max_tokens=2, messages=HELLO, stream=True)]
    assert events == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    _settled(shim, sim, waiter)
    assert _outcomes(shim) == {"admitted": 3, "completed": 3}


async def test_async_create_and_stream_through_the_shim(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    sim = make_sim()
    shim = make_shim(sim.url)
    client = anthropic.AsyncAnthropic(base_url=shim.url, api_key="unused", max_retries=0)
    message = await client.messages.create(model="sim-model", max_tokens=2, messages=HELLO)
    assert message.content[0].type == "text"
    assert message.content[0].text == "token0 token1"
    async with client.messages.stream(model="sim-model", max_tokens=100, messages=HELLO) as stream:
        text = "".join([piece async for piece in stream.text_stream])
    assert text == "token0 token1 token2 token3 token4"
    await client.close()
    _settled(shim, sim, waiter)


class _Holder:
    """A stream through the shim that keeps the shim's only slot until :meth:`close`."""

    def __init__(self, shim_url: str) -> None:
        client = anthropic.Anthropic(base_url=shim_url, api_key="unused", max_retries=0)
        self._stream = client.messages.create(model="m", max_tokens=1_000_000, messages=HELLO, stream=True)
        self._events = iter(self._stream)  # kept: a dropped iterator may close the response
        assert next(self._events).type == "message_start"  # admitted and generating

    def close(self) -> None:
        self._stream.close()


def _busy_shim(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], **settings: Any
) -> tuple[Sim, Any, _Holder]:
    sim = make_sim(output_tokens=1_000_000, itl=0.01)
    shim = make_shim(sim.url, max_concurrency=1, max_queue=0, **FAST_HINTS, **settings)
    return sim, shim, _Holder(shim.url)


@pytest.mark.parametrize("from_head", [True, False], ids=["refused-from-head", "refused-after-body"])
def test_with_retries_off_an_overloaded_shim_raises_overloaded_error_with_the_hint(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None], from_head: bool
) -> None:
    sim, shim, holder = _busy_shim(make_sim, make_shim, tuning=Tuning(refuse_from_head=from_head))
    client = anthropic.Anthropic(base_url=shim.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.OverloadedError) as caught:
        client.messages.create(model="sim-model", max_tokens=3, messages=HELLO)
    error = caught.value
    assert error.status_code == 529
    assert int(error.response.headers["retry-after"]) >= 1
    assert int(error.response.headers["retry-after-ms"]) == 50
    assert isinstance(error.body, dict)
    assert error.body["type"] == "error"
    assert error.body["error"]["type"] == "overloaded_error"
    assert error.body["error"]["code"] == "queue_full"
    assert error.body["error"]["retry_after_seconds"] == 0.05
    holder.close()
    _settled(shim, sim, waiter)
    assert _outcomes(shim) == {"admitted": 1, "client_disconnected": 1, "rejected": 1}


async def test_with_retries_off_the_async_client_raises_overloaded_error_too(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    sim, shim, holder = _busy_shim(make_sim, make_shim)
    client = anthropic.AsyncAnthropic(base_url=shim.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.OverloadedError) as caught:
        async with client.messages.stream(model="sim-model", max_tokens=3, messages=HELLO) as stream:
            await stream.get_final_message()
    assert caught.value.response.headers["retry-after-ms"] == "50"
    await client.close()
    holder.close()
    _settled(shim, sim, waiter)


def _ride_out(shim: Any, holder: _Holder, waiter: Callable[..., None], call: Callable[[], str]) -> str:
    """Run ``call`` (which retries on its own) while the slot is held; free it after two refusals."""
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    waiter(lambda: _outcomes(shim).get("rejected", 0) >= 2, timeout=30, what="two refusals")
    holder.close()
    thread.join(60)
    assert not thread.is_alive()
    (text,) = result
    return text


def test_the_sdks_own_retries_ride_out_the_shims_refusals(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    sim, shim, holder = _busy_shim(make_sim, make_shim)
    client = anthropic.Anthropic(base_url=shim.url, api_key="unused", max_retries=1000)

    def call() -> str:
        message = client.messages.create(model="sim-model", max_tokens=3, messages=HELLO)
        block = message.content[0]
        assert block.type == "text"
        return block.text

    assert _ride_out(shim, holder, waiter, call) == "token0 token1 token2"
    _settled(shim, sim, waiter)
    outcomes = _outcomes(shim)
    # Every attempt but the last was refused at once; the last was served.
    assert outcomes["rejected"] >= 2
    assert outcomes["admitted"] == 2
    assert outcomes["completed"] == 1
    assert outcomes["client_disconnected"] == 1
    assert set(outcomes) == {"admitted", "completed", "client_disconnected", "rejected"}


def test_a_stream_rides_out_the_refusals_before_it_starts(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    sim, shim, holder = _busy_shim(make_sim, make_shim)
    client = anthropic.Anthropic(base_url=shim.url, api_key="unused", max_retries=1000)

    def call() -> str:
        with client.messages.stream(model="sim-model", max_tokens=2, messages=HELLO) as stream:
            return "".join(stream.text_stream)

    assert _ride_out(shim, holder, waiter, call) == "token0 token1"
    _settled(shim, sim, waiter)
    assert _outcomes(shim)["completed"] == 1


async def test_the_async_sdks_retries_ride_out_the_refusals_of_a_stream(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    sim, shim, holder = _busy_shim(make_sim, make_shim)
    client = anthropic.AsyncAnthropic(base_url=shim.url, api_key="unused", max_retries=1000)

    async def call() -> str:
        async with client.messages.stream(model="sim-model", max_tokens=2, messages=HELLO) as stream:
            return "".join([piece async for piece in stream.text_stream])

    task = asyncio.ensure_future(call())
    # Polled off the loop, which must stay free for the client's retries.
    await asyncio.to_thread(waiter, lambda: _outcomes(shim).get("rejected", 0) >= 2, 30, "two refusals")
    holder.close()
    assert await asyncio.wait_for(task, 60) == "token0 token1"
    await client.close()
    await asyncio.to_thread(_settled, shim, sim, waiter)
    outcomes = _outcomes(shim)
    assert (outcomes["admitted"], outcomes["completed"], outcomes["client_disconnected"]) == (2, 1, 1)


def test_no_upstream_raises_service_unavailable_in_the_anthropic_shape(make_shim: Callable[..., Any]) -> None:
    closed = free_socket("127.0.0.1")
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    shim = make_shim(f"http://127.0.0.1:{port}", **FAST_HINTS)
    client = anthropic.Anthropic(base_url=shim.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.ServiceUnavailableError) as caught:
        client.messages.create(model="sim-model", max_tokens=3, messages=HELLO)
    assert caught.value.status_code == 503
    assert "retry-after" in caught.value.response.headers
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["type"] == "overloaded_error"
    assert caught.value.body["error"]["code"] == "upstream_unavailable"
    assert shim.state() == IDLE


def test_a_tenant_over_quota_raises_rate_limit_error(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    sim = make_sim()
    shim = make_shim(sim.url, tenant_header="x-tenant", tenant_requests_per_minute=1)
    client = anthropic.Anthropic(
        base_url=shim.url, api_key="unused", max_retries=0, default_headers={"x-tenant": "team-a"}
    )
    client.messages.create(model="sim-model", max_tokens=1, messages=HELLO)
    with pytest.raises(anthropic.RateLimitError) as caught:
        client.messages.create(model="sim-model", max_tokens=1, messages=HELLO)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert caught.value.body["error"]["code"] == "tenant_rate_limited"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    _settled(shim, sim, waiter)


def test_client_mistakes_are_typed_4xx_errors_the_sdk_does_not_retry(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    sim = make_sim()
    shim = make_shim(sim.url, api_key="s3cret")
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=shim.url, api_key="wrong", max_retries=3).messages.create(
            model="sim-model", max_tokens=1, messages=HELLO
        )
    assert isinstance(denied.value.body, dict)
    assert denied.value.body["error"]["type"] == "authentication_error"
    # Anthropic's SDKs have sent the key as x-api-key or as a Bearer token: both are read.
    raw = httpx.post(
        shim.url + "/v1/messages",
        json={"model": "sim-model", "max_tokens": 1, "messages": HELLO},
        headers={"x-api-key": "s3cret"},
    )
    assert raw.status_code == 200
    client = anthropic.Anthropic(base_url=shim.url, api_key="s3cret", max_retries=3)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="sim-model", max_tokens=1, messages=HELLO, extra_headers={"x-request-class": "nope"}
        )
    assert isinstance(bad.value.body, dict)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert bad.value.body["error"]["code"] == "invalid_request_class"
    message = client.messages.create(model="sim-model", max_tokens=1, messages=HELLO)
    assert message.usage.output_tokens == 1
    _settled(shim, sim, waiter)
    assert _outcomes(shim) == {"admitted": 2, "completed": 2}
    bad_requests = {
        dict(labels)["reason"]: value
        for (name, labels), value in shim.metrics().items()
        if name == "llm_backoff_shim_bad_requests_total" and value
    }
    assert bad_requests == {"unauthorized": 1, "invalid_request_class": 1}  # one attempt each: not retried


# -- the shape mapping and the simulator's endpoint, without the SDK ---------------------------


@pytest.mark.parametrize(
    ("code", "kind", "status", "expected_status", "expected_type"),
    [
        ("queue_full", "server_overloaded", 429, 529, "overloaded_error"),
        ("slo_shed", "server_overloaded", 503, 529, "overloaded_error"),  # --reject-status 503
        ("tenant_rate_limited", "rate_limit_exceeded", 429, 429, "rate_limit_error"),
        ("upstream_unavailable", "server_overloaded", 503, 503, "overloaded_error"),
    ],
)
def test_refusals_map_to_anthropics_statuses_and_types(
    code: str, kind: Any, status: int, expected_status: int, expected_type: str
) -> None:
    rejection = Rejection(code=code, message="busy", retry_after=2.5, queue_depth=4, type=kind, status=status)
    openai_shaped = rejection_response(rejection, 429)
    answer = in_shape(openai_shaped, Shape.ANTHROPIC)
    assert answer.status == expected_status
    body = json.loads(answer.body)
    assert body == {
        "type": "error",
        "error": {
            "type": expected_type,
            "message": "busy, retry in 3 s",
            "code": code,
            "retry_after_seconds": 2.5,
            "queue_depth": 4,
        },
    }
    headers = dict(answer.headers)
    assert headers[b"retry-after"] == b"3"
    assert headers[b"retry-after-ms"] == b"2500"
    assert headers[b"content-length"] == str(len(answer.body)).encode()
    assert in_shape(openai_shaped, Shape.OPENAI) is openai_shaped


def test_client_errors_keep_their_status_and_headers_in_the_anthropic_shape() -> None:
    too_large = client_error("request body larger than 10 bytes", code="request_too_large", status=413)
    too_large.headers.append((b"connection", b"close"))
    answer = in_shape(too_large, Shape.ANTHROPIC)
    assert answer.status == 413
    assert json.loads(answer.body)["error"]["type"] == "request_too_large"
    assert (b"connection", b"close") in answer.headers
    assert [k for k, _ in answer.headers].count(b"content-type") == 1


def test_the_simulators_messages_endpoint_answers_in_anthropics_shape(make_sim: Callable[..., Sim]) -> None:
    sim = make_sim(max_num_seqs=1, max_num_queued_reqs=2, output_tokens=1_000_000, itl=0.01)
    url = sim.url + "/v1/messages"
    for body, needle in (
        ({"messages": HELLO}, "max_tokens"),
        ({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": 3}]}, "content"),
        ({"max_tokens": 1, "messages": HELLO, "stream": "yes"}, "stream"),
    ):
        answer = httpx.post(url, json=body)
        assert answer.status_code == 400
        assert answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert needle in answer.json()["error"]["message"]
    assert httpx.get(url).status_code == 405
    stream_body = {"max_tokens": 1_000_000, "messages": HELLO, "stream": True}
    with httpx.stream("POST", url, json=stream_body) as running:
        lines = running.iter_lines()  # kept: a dropped line iterator closes the response
        assert next(lines) == "event: message_start"
        # The headers of a stream come once the engine took it: this one waits in its queue.
        with httpx.stream("POST", url, json=stream_body) as waiting:
            assert waiting.status_code == 200
            assert sim.runtime.engine.num_waiting == 1
            full = httpx.post(url, json={"max_tokens": 1, "messages": HELLO})
    assert full.status_code == 503
    overloaded = {"type": "overloaded_error", "message": "Request queue full."}
    assert full.json() == {"type": "error", "error": overloaded}
    assert sim.runtime.stats.requests_invalid == 4


# llm_backoff.wrap() on the anthropic SDK's clients, through the shim's /v1/messages: the
# wrapped client's own retry engine (the SDK's retries are off in the copy) rides out the
# shim's 529s, honouring their hints, and gives up with anthropic's typed error when its
# deadline cannot be met.


def _wrapped(client: Any, deadline: float = 30) -> Any:
    import llm_backoff

    return llm_backoff.wrap(client, llm_backoff.RetryPolicy(deadline=deadline), request_class="interactive")


def test_a_wrapped_client_rides_out_the_shims_refusals(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    import llm_backoff

    sim, shim, holder = _busy_shim(make_sim, make_shim)
    client = _wrapped(anthropic.Anthropic(base_url=shim.url, api_key="unused"))

    def call() -> str:
        with client.messages.stream(model="sim-model", max_tokens=2, messages=HELLO) as stream:
            return "".join(stream.text_stream)

    assert _ride_out(shim, holder, waiter, call) == "token0 token1"
    stats = llm_backoff.client_stats(client).snapshot()
    _settled(shim, sim, waiter)
    outcomes = _outcomes(shim)
    # Every refused attempt is one of the wrapped client's retries; the last one was served.
    assert stats.calls == 1
    assert stats.failed_calls == 0
    assert stats.retries == outcomes["rejected"] >= 2
    assert stats.attempts == stats.retries + 1
    assert (outcomes["admitted"], outcomes["completed"]) == (2, 1)


async def test_a_wrapped_async_client_rides_out_the_shims_refusals(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    import llm_backoff

    sim, shim, holder = _busy_shim(make_sim, make_shim)
    client = _wrapped(anthropic.AsyncAnthropic(base_url=shim.url, api_key="unused"))
    task = asyncio.ensure_future(client.messages.create(model="sim-model", max_tokens=3, messages=HELLO))
    await asyncio.to_thread(waiter, lambda: _outcomes(shim).get("rejected", 0) >= 2, 30, "two refusals")
    holder.close()
    message = await asyncio.wait_for(task, 60)
    assert message.content[0].text == "token0 token1 token2"
    stats = llm_backoff.client_stats(client).snapshot()
    await client.close()
    await asyncio.to_thread(_settled, shim, sim, waiter)
    assert stats.retries == _outcomes(shim)["rejected"] >= 2


def test_a_wrapped_client_whose_deadline_cannot_be_met_raises_overloaded_error(
    make_sim: Callable[..., Sim], make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    # Hints of 5 s against a 1 s deadline: the wrapped client does not wait out a hint it
    # cannot use, and the caller sees anthropic's own typed error with the attempts noted.
    sim = make_sim(output_tokens=1_000_000, itl=0.01)
    shim = make_shim(sim.url, max_concurrency=1, max_queue=0, retry_after_min=5, retry_after_max=5)
    holder = _Holder(shim.url)
    client = _wrapped(anthropic.Anthropic(base_url=shim.url, api_key="unused"), deadline=1)
    with pytest.raises(anthropic.OverloadedError) as caught:
        client.messages.create(model="sim-model", max_tokens=3, messages=HELLO)
    assert caught.value.status_code == 529
    assert caught.value.response.headers["retry-after-ms"] == "5000"
    assert len(caught.value.llm_backoff_attempts) == 1  # type: ignore[attr-defined]
    holder.close()
    _settled(shim, sim, waiter)
    assert _outcomes(shim)["rejected"] == 1
