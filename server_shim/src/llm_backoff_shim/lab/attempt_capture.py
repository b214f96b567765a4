"""Every HTTP attempt of a call, seen from below the clients' retry loops.

:class:`CountingTransport` sits *below* openai's own retry loop and below llm_backoff's
retrying transport, so every attempt of either is recorded (an
:class:`~llm_backoff_shim.lab.load_records.AttemptRecord`: sent, written, response head
read, status, error code). It finds the call an attempt belongs to through a context
variable (:func:`bind_call`): the transport runs in the task of the call that sends.
"""

from __future__ import annotations

import contextvars
import importlib
import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

import openai

from llm_backoff_shim.lab.load_records import AttemptRecord, CallRecord, attempt_id

_CURRENT_CALL: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar(
    "llm_backoff_shim_loadgen_call", default=None
)


def http_library() -> ModuleType:
    """``httpx2`` for openai 3.x, ``httpx`` for openai 2.x: the library openai's clients are built on."""
    for klass in openai.DefaultAsyncHttpxClient.__mro__:
        root = klass.__module__.split(".", 1)[0]
        if root in ("httpx2", "httpx"):
            return importlib.import_module(root)
    raise RuntimeError("cannot tell which HTTP library this openai version uses")


def bind_call(record: CallRecord) -> None:
    """Attribute the HTTP attempts made from now on in this task (context) to ``record``."""
    _CURRENT_CALL.set(record)


class CountingTransport:
    """Records every HTTP attempt on the current call, then hands the request on.

    Duck-typed (``handle_async_request``/``aclose``) rather than subclassing one
    library's base class, so the same class serves httpx and httpx2 clients.
    """

    def __init__(self, inner: Any, clock: Callable[[], float], byte_stream: Callable[[bytes], Any]) -> None:
        self.inner = inner
        self._clock = clock
        self._byte_stream = byte_stream

    async def handle_async_request(self, request: Any) -> Any:
        call = _CURRENT_CALL.get()
        record: AttemptRecord | None = None
        if call is not None:
            record = AttemptRecord(number=len(call.attempts) + 1, sent=self._clock())
            call.attempts.append(record)
            # Lets the shim's access log be matched with this attempt (attach_shim_times).
            request.headers["x-request-id"] = attempt_id(call.index, record.number)
            request.extensions["trace"] = _AttemptTrace(record, self._clock, request.extensions.get("trace"))
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException as exc:
            if record is not None:
                record.error = type(exc).__name__
            raise
        if record is not None:
            if record.answered is None:
                record.answered = self._clock()
            record.status = response.status_code
            if response.status_code >= 400:
                # Error bodies are small: read the raw bytes here and hand the layers
                # above a replayable stream of the same bytes.
                stream = response.stream
                try:
                    raw = b"".join([chunk async for chunk in stream])
                finally:
                    await stream.aclose()
                response.stream = self._byte_stream(raw)
                record.code = error_code(raw)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> CountingTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _AttemptTrace:
    """httpcore's ``trace`` extension for one attempt: stamps the write and the read.

    The time to a rejection is then taken from the moment the request goes onto the
    wire, not from when the client's task got round to sending it (taking a pooled
    connection or opening one, which under a burst waits for this process's busy event
    loop); the answer is stamped as soon as its head is parsed. A trace callback the
    caller set is still called. A retry loop may send the same request object again: the
    previous attempt's trace is then replaced, not chained, or its record would be
    stamped with the next attempt's times.
    """

    def __init__(self, record: AttemptRecord, clock: Callable[[], float], chained: Any) -> None:
        self._record = record
        self._clock = clock
        self._chained: Any = chained._chained if isinstance(chained, _AttemptTrace) else chained

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith("send_request_headers.started"):
            self._record.written = self._clock()
        elif event.endswith("send_request_body.complete"):
            self._record.body_sent = self._clock()
        elif event.endswith("receive_response_headers.complete"):
            self._record.answered = self._clock()
        if self._chained is not None:
            await self._chained(event, info)


def error_code(body: bytes) -> str | None:
    """``error.code`` of an OpenAI-format error body, or None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def describe_error(exc: BaseException) -> str:
    """A short, typed description: ``429 queue_full``, ``503``, ``connection error``...

    `` (start deadline)`` is added when ``llm_backoff`` gave up on the call's start deadline
    (its note on the error says so): the answer could not have begun within the caller's
    TTFT budget. Such a call failed fast, with a typed error, like any other here.
    """
    text = _describe(exc)
    notes = getattr(exc, "__notes__", None) or ()
    if any("start deadline" in str(note) for note in notes):
        text += " (start deadline)"
    return text


def _describe(exc: BaseException) -> str:
    if isinstance(exc, openai.APIStatusError):
        code = exc.code
        if code is None and isinstance(exc.body, dict):
            code = exc.body.get("code")
        return f"{exc.status_code} {code}" if code else str(exc.status_code)
    if isinstance(exc, openai.APITimeoutError):
        return "client timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection error"
    return type(exc).__name__
