"""A stream cut after content, continued from the text received (`RetryPolicy.continue_cut_streams`).

Real openai and anthropic clients, sync and async, against a server on 127.0.0.1 that cuts
its first stream after a few content events (drops the connection, ends it early, or sends
an error event) and answers the continuation request it then gets. The caller must see the
whole answer once, the continuation request must carry the received text and the reduced
token limit, and the call's attempts, deadline and budget must bound it. Without the policy
(the default) the cut reaches the caller as before. Waits are skipped with ``instant_retries``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import llm_backoff
from llm_backoff import RetryBudget, RetryPolicy
from llm_backoff.continuation import generation_of
from llm_backoff.testing import instant_retries

anthropic = pytest.importorskip("anthropic")

MESSAGES: Any = [{"role": "user", "content": "hi"}]
CUT = "<cut>"
"""In a script: the server drops the connection here."""
END = "<end>"
"""In a script: the server ends the stream here, before its end."""
CONTINUE = RetryPolicy(continue_cut_streams=True)


def data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def chat(delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None) -> str:
    choices = [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None else []
    body: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    body["choices"] = choices
    if usage is not None:
        body["usage"] = usage
    return data(body)


def completion(text: str, finish: str | None = None) -> str:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return data({"id": "t", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]})


def sse(event: str, payload: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(payload)}\n\n"


ROLE = chat({"role": "assistant", "content": ""})
DONE = "data: [DONE]\n\n"
USAGE = chat({}, usage={"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11})
ERROR_CHUNK = data({"error": {"message": "engine died (test)", "type": "server_error", "code": 503}})


def message_start() -> str:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }
    return sse("message_start", {"type": "message_start", "message": message})


def block_start(index: int) -> str:
    block = {"type": "text", "text": ""}
    return sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def text_delta(index: int, text: str) -> str:
    delta = {"type": "text_delta", "text": text}
    return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def block_stop(index: int) -> str:
    return sse("content_block_stop", {"type": "content_block_stop", "index": index})


def message_end(output_tokens: int) -> list[str]:
    delta = {"stop_reason": "end_turn", "stop_sequence": None}
    usage = {"output_tokens": output_tokens}
    return [
        sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}),
        sse("message_stop", {"type": "message_stop"}),
    ]


class Scripted:
    """Streams the scripts in turn, one per request, and keeps each request's JSON body."""

    def __init__(self, *scripts: list[str] | int) -> None:
        self.scripts = list(scripts)
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def calls(self) -> int:
        return len(self.bodies)

    def app(self) -> Starlette:
        async def answer(request: Request) -> Response:
            body = json.loads(await request.body())
            with self.lock:
                self.bodies.append(body)
                script = self.scripts[len(self.bodies) - 1]
            if isinstance(script, int):
                error = {"error": {"message": "not supported (test)", "type": "invalid_request_error"}}
                return JSONResponse(error, status_code=script)

            async def events() -> AsyncIterator[str]:
                for item in script:
                    if item == CUT:
                        raise RuntimeError("connection dropped mid-stream (test)")
                    if item == END:
                        return
                    yield item

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/v1/chat/completions", answer, methods=["POST"]),
                Route("/v1/completions", answer, methods=["POST"]),
                Route("/v1/messages", answer, methods=["POST"]),
            ]
        )


@pytest.fixture
def start(serve: Callable[[Any], str]) -> Callable[..., tuple[Scripted, str]]:
    def started(*scripts: list[str] | int) -> tuple[Scripted, str]:
        server = Scripted(*scripts)
        return server, serve(server.app())

    return started


def openai_client(lib: ModuleType, url: str, *, is_async: bool = False, **options: Any) -> Any:
    """A wrapped openai client over ``lib`` (httpx2, or a legacy httpx client)."""
    if lib.__name__ == "httpx2" and not openai.__version__.startswith("3."):
        pytest.skip("openai 2.x takes httpx clients only")
    cls = openai.AsyncOpenAI if is_async else openai.OpenAI
    http_client = lib.AsyncClient() if is_async else lib.Client()
    return llm_backoff.wrap(cls(api_key="sk-test", base_url=f"{url}/v1", http_client=http_client), **options)


def text_of(chunks: Any) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def statuses(response: Any) -> list[int | None]:
    return [a.status for a in response.extensions["llm_backoff.attempts"]]


CUT_CHAT = [ROLE, chat({"content": "Hello"}), chat({"content": " wor"}), CUT]
REST_CHAT = [ROLE, chat({"content": "ld"}), chat({"content": "!"}), chat({}, "stop"), USAGE, DONE]


# -- openai chat completions ---------------------------------------------------------------


def test_a_chat_stream_cut_after_content_goes_on_from_the_text_received(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(CUT_CHAT, REST_CHAT)
    client = openai_client(lib, url, policy=CONTINUE)
    with instant_retries():
        stream = client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=50, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
    assert text_of(chunks) == "Hello world!"
    assert [c.choices[0].delta.role for c in chunks if c.choices] == [
        "assistant",
        None,
        None,
        None,
        None,
        None,
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 2
    assert server.calls == 2
    continuation = server.bodies[1]
    assert continuation["messages"] == [*MESSAGES, {"role": "assistant", "content": "Hello wor"}]
    assert continuation["continue_final_message"] is True
    assert continuation["add_generation_prompt"] is False
    assert continuation["max_tokens"] == 50 - 2  # a token per text event
    assert statuses(stream.response) == [200, 200]
    cut = stream.response.extensions["llm_backoff.attempts"][0]
    assert cut.reason.endswith("after content")
    assert cut.error is not None


async def test_async_a_chat_stream_that_ends_early_goes_on(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start([ROLE, chat({"content": "Hello"}), END], REST_CHAT)
    client = openai_client(lib, url, is_async=True, policy=CONTINUE)
    with instant_retries():
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_completion_tokens=20, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert text_of(chunks) == "Hellold!"
    assert server.bodies[1]["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert server.bodies[1]["max_completion_tokens"] == 20 - 1
    assert "max_tokens" not in server.bodies[1]
    await client.close()


def test_an_error_event_after_content_goes_on_and_the_helper_sees_one_answer(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start([ROLE, chat({"content": "Hello"}), chat({"content": " wor"}), ERROR_CHUNK], REST_CHAT)
    client = openai_client(lib, url, policy=CONTINUE)
    with instant_retries(), client.chat.completions.stream(model="m", messages=MESSAGES) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Hello world!"
    assert final.choices[0].message.role == "assistant"
    assert final.choices[0].finish_reason == "stop"
    assert server.calls == 2


def test_a_continuation_cut_in_turn_goes_on_again(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(CUT_CHAT, [ROLE, chat({"content": "ld"}), CUT], REST_CHAT[2:])
    client = openai_client(lib, url, policy=CONTINUE)
    with instant_retries():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50, stream=True)
        assert text_of(stream) == "Hello world!"
    assert server.bodies[2]["messages"][-1] == {"role": "assistant", "content": "Hello world"}
    assert server.bodies[2]["max_tokens"] == 50 - 2 - 1
    assert server.calls == 3


def test_the_servers_count_of_tokens_received_is_taken_when_it_reports_one(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    counted = {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    choice = {"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}
    head = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    chunk = data({**head, "choices": [choice], "usage": counted})
    server, url = start([ROLE, chunk, CUT], REST_CHAT)
    client = openai_client(lib, url, policy=CONTINUE)
    with instant_retries():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50, stream=True)
        assert text_of(stream) == "Hellold!"
    assert server.bodies[1]["max_tokens"] == 50 - 7


# -- what bounds it, and what is not continued -----------------------------------------------


def test_without_the_policy_a_cut_is_raised_as_before(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(CUT_CHAT, REST_CHAT)
    client = openai_client(lib, url)
    received: list[str] = []
    with instant_retries():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises((openai.APIError, lib.HTTPError)) as info:
            received.extend(c.choices[0].delta.content for c in stream)
    assert received == ["", "Hello", " wor"]
    assert server.calls == 1
    assert "not retried, so no output is duplicated" in "\n".join(info.value.__notes__)


def test_a_stream_that_ended_early_and_is_not_continued_is_not_passed_off_as_whole(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start([ROLE, chat({"content": "Hello"}), END], REST_CHAT)
    client = openai_client(lib, url, policy=RetryPolicy(continue_cut_streams=True, max_attempts=1))
    received: list[str] = []
    with instant_retries():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises((openai.APIConnectionError, lib.RemoteProtocolError)) as info:
            received.extend(c.choices[0].delta.content for c in stream)
    assert received == ["", "Hello"]
    assert server.calls == 1
    assert "max_attempts (1) reached" in "\n".join(info.value.__notes__)


def test_max_attempts_bounds_the_continuations(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(CUT_CHAT, [ROLE, chat({"content": "ld"}), CUT], REST_CHAT)
    policy = RetryPolicy(continue_cut_streams=True, max_attempts=2)
    client = openai_client(lib, url, policy=policy)
    received: list[str] = []
    with instant_retries():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises((openai.APIError, lib.HTTPError)) as info:
            received.extend(c.choices[0].delta.content for c in stream)
    assert "".join(received) == "Hello world"
    assert server.calls == 2
    assert [a.status for a in info.value.llm_backoff_attempts] == [200, 200]  # type: ignore[attr-defined]
    assert "max_attempts (2) reached" in "\n".join(info.value.__notes__)


def test_the_deadline_bounds_a_continuation(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    hinted = data(
        {"error": {"message": "busy", "type": "server_error", "code": 503, "retry_after_seconds": 30}}
    )
    server, url = start([ROLE, chat({"content": "Hello"}), hinted], REST_CHAT)
    client = openai_client(lib, url, policy=RetryPolicy(continue_cut_streams=True, deadline=5))
    with pytest.raises(openai.APIError) as info:  # waits are real here: none is taken
        list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert server.calls == 1
    attempts = info.value.llm_backoff_attempts  # type: ignore[attr-defined]
    assert [(a.status, a.hint, a.wait) for a in attempts] == [(200, 30.0, None)]


def test_the_retry_budget_bounds_a_continuation(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(CUT_CHAT, REST_CHAT)
    client = openai_client(lib, url, policy=CONTINUE, budget=RetryBudget(ratio=0, min_per_second=0))
    with instant_retries(), pytest.raises((openai.APIError, lib.HTTPError)) as info:
        list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert server.calls == 1
    assert "retry budget exhausted" in "\n".join(info.value.__notes__)


def test_a_refused_continuation_gives_the_cut_with_the_reason(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(CUT_CHAT, 400)
    client = openai_client(lib, url, policy=CONTINUE)
    with instant_retries(), pytest.raises((openai.APIError, lib.HTTPError)) as info:
        list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert server.calls == 2
    assert [a.status for a in info.value.llm_backoff_attempts] == [200, 400]  # type: ignore[attr-defined]
    assert "the continuation was answered 400" in "\n".join(info.value.__notes__)


@pytest.mark.parametrize(
    "cut",
    [
        [ROLE, chat({"content": "Hi"}), chat({}, "stop"), CUT],
        [
            ROLE,
            chat({"content": "Hi"}),
            chat({"tool_calls": [{"index": 0, "id": "t", "type": "function"}]}),
            CUT,
        ],
    ],
    ids=["after-the-finish", "after-a-tool-call"],
)
def test_what_is_not_continued_is_raised_as_before(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]], cut: list[str]
) -> None:
    server, url = start(cut, REST_CHAT)
    client = openai_client(lib, url, policy=CONTINUE)
    with instant_retries(), pytest.raises((openai.APIError, lib.HTTPError)):
        list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert server.calls == 1


@pytest.mark.parametrize(
    ("url", "body", "continued"),
    [
        ("http://vllm:8000/v1/chat/completions", {"messages": [], "stream": True}, True),
        ("https://api.openai.com/v1/chat/completions", {"messages": [], "stream": True}, False),
        (
            "https://x.openai.azure.com/openai/deployments/d/chat/completions",
            {"messages": [], "stream": True},
            False,
        ),
        ("https://api.openai.com/v1/completions", {"prompt": "a", "stream": True}, True),
        ("http://vllm:8000/v1/chat/completions", {"messages": [], "stream": False}, False),
        ("http://vllm:8000/v1/chat/completions", {"messages": [], "stream": True, "n": 2}, False),
        ("http://vllm:8000/v1/completions", {"prompt": [1, 2], "stream": True}, False),
        (
            "http://vllm:8000/v1/chat/completions",
            {"messages": [], "stream": True, "response_format": {"type": "json_object"}},
            False,
        ),
        ("http://vllm:8000/v1/embeddings", {"input": "a", "stream": True}, False),
    ],
)
def test_which_generations_are_continued(url: str, body: dict[str, Any], continued: bool) -> None:
    request = httpx.Request("POST", url, json=body)
    assert (generation_of(request) is not None) is continued


# -- legacy completions ----------------------------------------------------------------------


def test_a_completion_stream_goes_on_with_the_text_appended_to_the_prompt(
    lib: ModuleType, start: Callable[..., tuple[Scripted, str]]
) -> None:
    server, url = start(
        [completion("Once"), completion(" upon"), CUT], [completion(" a time"), completion("", "stop"), DONE]
    )
    client = openai_client(lib, url, policy=CONTINUE)
    with instant_retries():
        stream = client.completions.create(model="m", prompt="Tell me:", max_tokens=16, stream=True)
        text = "".join(c.choices[0].text for c in stream)
    assert text == "Once upon a time"
    assert server.bodies[1]["prompt"] == "Tell me:Once upon"
    assert server.bodies[1]["max_tokens"] == 16 - 2


# -- anthropic -------------------------------------------------------------------------------


def test_an_anthropic_stream_goes_on_from_a_prefill(start: Callable[..., tuple[Scripted, str]]) -> None:
    cut = [message_start(), block_start(0), text_delta(0, "Hello "), CUT]
    rest = [
        message_start(),
        block_start(0),
        text_delta(0, " world"),
        text_delta(0, "!"),
        block_stop(0),
        *message_end(2),
    ]
    server, url = start(cut, rest)
    client = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"), CONTINUE)
    with instant_retries(), client.messages.stream(model="m", max_tokens=32, messages=MESSAGES) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Hello world!"
    assert [block.text for block in final.content if block.type == "text"] == ["Hello world!"]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 2
    continuation = server.bodies[1]
    # Anthropic refuses trailing whitespace in a prefill: it is held back, and taken off the continuation
    assert continuation["messages"] == [*MESSAGES, {"role": "assistant", "content": "Hello"}]
    assert continuation["max_tokens"] == 32 - 2  # "Hello ": one event, but 6 characters: ceil(6 / 4)


async def test_async_anthropic_goes_on_after_a_closed_block_and_a_prefill_of_its_own(
    start: Callable[..., tuple[Scripted, str]],
) -> None:
    cut = [message_start(), block_start(0), text_delta(0, "Hello"), block_stop(0), END]
    rest = [message_start(), block_start(0), text_delta(0, "Bye"), block_stop(0), *message_end(1)]
    server, url = start(cut, rest)
    client = llm_backoff.wrap(anthropic.AsyncAnthropic(base_url=url, api_key="k"), CONTINUE)
    prefilled = [*MESSAGES, {"role": "assistant", "content": "Well: "}]
    with instant_retries():
        async with client.messages.stream(model="m", max_tokens=32, messages=prefilled) as stream:
            final = await stream.get_final_message()
    assert [block.text for block in final.content if block.type == "text"] == ["Hello", "Bye"]
    assert server.bodies[1]["messages"][-1] == {"role": "assistant", "content": "Well: Hello"}
    await client.close()


def test_an_anthropic_continuation_that_calls_a_tool_closes_the_cut_text_block(
    start: Callable[..., tuple[Scripted, str]],
) -> None:
    tool = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}
    arguments = {"type": "input_json_delta", "partial_json": '{"q": "x"}'}
    rest = [
        message_start(),
        sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": tool}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": arguments}),
        block_stop(0),
        *message_end(5),
    ]
    server, url = start([message_start(), block_start(0), text_delta(0, "Let me look."), CUT], rest)
    client = llm_backoff.wrap(anthropic.Anthropic(base_url=url, api_key="k"), CONTINUE)
    with instant_retries(), client.messages.stream(model="m", max_tokens=32, messages=MESSAGES) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me look."  # type: ignore[union-attr]
    assert final.content[1].input == {"q": "x"}  # type: ignore[union-attr]
    assert server.calls == 2


# -- the real fault: an engine killed under a stream, behind a shim -------------------------------


def test_a_stream_cut_by_an_engine_killed_behind_a_shim_is_whole_once_it_is_back() -> None:
    """The simulator (a child process) behind a real shim is SIGKILLed after a few tokens of a
    stream; the caller's retry hook brings it back on its port, and the continuation (the
    simulator continues a final assistant message as vLLM does) completes the one answer."""
    procs = pytest.importorskip("llm_backoff_shim.lab.procs")
    app_module = pytest.importorskip("llm_backoff_shim.serve.app")
    settings_module = pytest.importorskip("llm_backoff_shim.serve.config.settings")
    serving = pytest.importorskip("llm_backoff_shim.serve.serving")
    tokens = 100
    with procs.sim_server(["--ttft", "0", "--itl", "0.02"]) as engine:
        settings = settings_module.ShimSettings(upstream=engine.url, log_level="error")
        shim = serving.shim_server(app_module.create_app(settings)).start()
        try:
            events: list[llm_backoff.RetryEvent] = []

            def on_retry(event: llm_backoff.RetryEvent) -> None:
                events.append(event)
                if len(events) == 1:  # the cut: the engine comes back before the continuation
                    engine.restart()

            client = llm_backoff.wrap(
                openai.OpenAI(base_url=shim.url + "/v1", api_key="x"), CONTINUE, on_retry=on_retry
            )
            received: list[str] = []
            with instant_retries():
                stream = client.chat.completions.create(
                    model="sim-model",
                    messages=MESSAGES,
                    max_tokens=tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        received.append(chunk.choices[0].delta.content)
                        if len(received) == 5:
                            engine.kill()
        finally:
            shim.stop()
    assert "".join(received) == "token0" + "".join(f" token{i}" for i in range(1, tokens))
    # the shim ends the stream with an error event when its engine dies under it
    assert events[0].reason == "status 503 (server_error event after content)"
    history = stream.response.extensions["llm_backoff.attempts"]
    assert [(a.status, a.reason) for a in history] == [(200, events[0].reason), (200, "status 200")]
