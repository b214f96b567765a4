"""attempt_core.call_steps stepped by hand: the effects one call asks for, with no loop and no I/O."""

from __future__ import annotations

from collections.abc import Generator
from types import ModuleType
from typing import Any

import pytest

from llm_backoff import RetryPolicy
from llm_backoff.attempt_core import Acquire, Close, ReadBody, Send, Sleep, call_steps
from llm_backoff.bodies import Flavor
from llm_backoff.engine import RetryEngine
from llm_backoff.testing import instant_retries


class _Permit:
    def __init__(self, settled: list[int | None]) -> None:
        self._settled = settled

    def settle(self, *, status: int | None, body: bytes | None) -> None:
        self._settled.append(status)


class _Limiter:
    def __init__(self) -> None:
        self.settled: list[int | None] = []

    def acquire_for(self, request: Any, *, timeout: float | None) -> _Permit:
        return _Permit(self.settled)

    async def acquire_for_async(self, request: Any, *, timeout: float | None) -> _Permit:
        return _Permit(self.settled)


def _flavor(lib: ModuleType) -> Flavor:
    return Flavor(
        byte_stream=lib.ByteStream,
        guarded_stream=lambda stream, guard: stream,
        replayed_stream=lambda head, rest, stream: stream,
    )


def _response(lib: ModuleType, status: int) -> tuple[Any, bytes]:
    body = b'{"ok": true}'
    return lib.Response(status, headers={"content-type": "application/json"}, content=body), body


def _run(
    steps: Generator[Any, Any, Any], answers: list[Any], limiter: _Limiter | None = None
) -> tuple[list[type], Any]:
    """Step ``steps``, answering each `Send` with the next of ``answers`` (an exception is thrown in)."""
    kinds: list[type] = []
    effect = next(steps)
    try:
        while True:
            kinds.append(type(effect))
            if isinstance(effect, Send):
                answer = answers.pop(0)
                effect = steps.throw(answer) if isinstance(answer, BaseException) else steps.send(answer)
            elif isinstance(effect, Acquire):
                assert limiter is not None
                effect = steps.send(limiter.acquire_for(None, timeout=effect.timeout))
            else:
                effect = steps.send(None)
    except StopIteration as done:
        return kinds, done.value


def test_a_retried_status_asks_for_close_sleep_and_a_fresh_permit(lib: ModuleType, fake_time: Any) -> None:
    limiter = _Limiter()
    engine = RetryEngine(RetryPolicy(), limiter=limiter, **fake_time.engine_options())
    request = lib.Request("POST", "http://engine/v1/chat/completions", json={"model": "m"})
    kinds, response = _run(
        call_steps(engine, request, _flavor(lib)), [_response(lib, 503), _response(lib, 200)], limiter
    )
    assert kinds == [ReadBody, Acquire, Send, Close, Sleep, Acquire, Send]
    assert response.status_code == 200
    assert [a.status for a in response.extensions["llm_backoff.attempts"]] == [503, 200]
    assert limiter.settled == [503, 200]  # each permit settled once, with its attempt's status


def test_a_send_stamps_the_time_left_and_the_deadline(lib: ModuleType, fake_time: Any) -> None:
    engine = RetryEngine(RetryPolicy(deadline=30, start_deadline=5), **fake_time.engine_options())
    request = lib.Request("POST", "http://engine/v1/chat/completions", json={"model": "m"})
    steps = call_steps(engine, request, _flavor(lib))
    assert isinstance(next(steps), ReadBody)
    send = steps.send(None)
    assert send[:3] == (5.0, fake_time.now + 30, True)
    assert request.headers["x-request-timeout-ms"] == "5000"
    assert request.extensions["timeout"]["read"] == 5.0
    # once a stream's head has come, its body reads answer to the deadline
    assert send.begin is not None
    fake_time.now += 1
    send.begin()
    assert request.extensions["timeout"]["read"] == 29.0
    steps.close()


def test_an_error_that_is_not_retried_leaves_the_steps_annotated(lib: ModuleType, fake_time: Any) -> None:
    engine = RetryEngine(RetryPolicy(), **fake_time.engine_options())
    request = lib.Request("GET", "http://engine/v1/models")
    with pytest.raises(ValueError, match="bad") as info:
        _run(call_steps(engine, request, _flavor(lib)), [ValueError("bad")])
    assert [a.error for a in info.value.llm_backoff_attempts] == ["ValueError: bad"]  # type: ignore[attr-defined]
    assert engine.stats.snapshot().failed_calls == 1


def test_instant_retries_ask_for_no_sleep(lib: ModuleType, fake_time: Any) -> None:
    engine = RetryEngine(RetryPolicy(), **fake_time.engine_options())
    request = lib.Request("GET", "http://engine/v1/models")
    with instant_retries():
        kinds, response = _run(
            call_steps(engine, request, _flavor(lib)),
            [lib.ReadError("reset"), _response(lib, 200)],
        )
    assert kinds == [ReadBody, Send, Send]
    assert response.extensions["llm_backoff.attempts"][0].wait is not None  # computed and recorded
