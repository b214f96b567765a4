"""The start of an event stream: read up to its first content, so that a failure before it is retried.

A 200 ``text/event-stream`` answer can still fail before it has given the caller
anything: an error event first (Anthropic's ``overloaded_error``, an OpenAI-style
``data: {"error": {...}}`` chunk from vLLM or a proxy), or the stream ending or breaking
off. Nothing has been used then, so such an attempt is retried like the status it stands
for. The transport reads the stream's events (`StreamStart`) until one carries content
for the caller, and then hands over a stream that yields the bytes read so far and then
the rest, unchanged; the first content is handed over as soon as it has arrived.

Content is any event but these, which come before content and say nothing yet:

- an OpenAI chat (or completions) chunk without a ``finish_reason`` whose choices carry
  nothing but a ``role`` (``{"delta": {"role": "assistant", "content": ""}}``), or with no
  choices and no ``usage`` (Azure's ``prompt_filter_results``);
- OpenAI Responses API ``response.created``, ``response.queued`` and ``response.in_progress``;
- Anthropic ``message_start``, ``ping``, and a ``content_block_start`` of an empty text block;
- SSE comments and events without data.

``[DONE]`` and events of any other shape are content: an unknown stream is handed over at
its first event. After `MAX_OPENING` bytes without content the stream is handed over too.

Before content:

- an error event (SSE ``event: error``, a ``{"type": "error"}`` object, an ``"error"``
  member, a ``response.failed``) -> an answer with the status it names (`error_status`),
  its body the event's JSON: 529 for ``overloaded_error``, 429 for a rate limit, the
  ``code`` when it is an HTTP error status (vLLM), else 503. It is classified, hinted
  (``retry-after`` headers of the 200, ``retry_after_seconds`` in the event) and retried
  as that status; when retrying ends it is the answer, so the client raises its error
  for that status (``anthropic.OverloadedError``, ``openai.RateLimitError``...);
- the stream ends -> the HTTP library's ``RemoteProtocolError``; it breaks -> its error.
  Either is a connection error (``retry_connection_errors``), raised when retrying ends.

Pure but for `open_sync`/`open_async`, which read the stream.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, NamedTuple

from .bodies import DeadlinePassedError, Flavor, is_event_stream

__all__ = [
    "MAX_OPENING",
    "STREAM_ERROR_KEY",
    "ErrorEvent",
    "StreamStart",
    "aclose_iterated",
    "classify_event",
    "close_iterated",
    "ended_error",
    "error_response",
    "error_status",
    "open_async",
    "open_sync",
    "opens_stream",
]

#: Bytes read without content after which the stream is handed over as it is.
MAX_OPENING = 1024 * 1024

#: Key in ``response.extensions`` of an answer made from an error event: what the event was.
STREAM_ERROR_KEY = "llm_backoff.stream_error"

#: Error types (Anthropic's, OpenAI's) and the status each stands for.
_NAMED_STATUS: Mapping[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "rate_limit_exceeded": 429,
    "insufficient_quota": 429,
    "api_error": 500,
    "overloaded_error": 529,
}
#: The status of an error event that names none: the server cannot serve the call now.
_DEFAULT_STATUS = 503

_ANTHROPIC_OPENING = frozenset({"message_start", "ping"})
_RESPONSES_OPENING = frozenset({"response.created", "response.queued", "response.in_progress"})
_EMPTY: tuple[object, ...] = (None, "", [], {})


class ErrorEvent(NamedTuple):
    """An error event before any content: the status it stands for and its JSON body."""

    status: int
    body: Mapping[str, object]
    kind: str
    """Its ``type`` (or ``code``): ``"overloaded_error"``; ``"error"`` when it names none."""


def error_status(body: Mapping[str, object]) -> int:
    """The status an error event stands for: its ``code``/``status`` if an HTTP error status,
    else by its ``type``/``code`` name (`_NAMED_STATUS`), else 503."""
    error = body.get("error")
    inner: Mapping[str, object] = error if isinstance(error, Mapping) else body
    for key in ("code", "status", "status_code"):
        value = inner.get(key)
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599:
            return value
    for key in ("type", "code"):
        value = inner.get(key)
        if isinstance(value, str) and value in _NAMED_STATUS:
            return _NAMED_STATUS[value]
    return _DEFAULT_STATUS


def _error_event(body: Mapping[str, object]) -> ErrorEvent:
    error = body.get("error")
    inner = error if isinstance(error, Mapping) else body
    kind = next((v for v in (inner.get("type"), inner.get("code")) if isinstance(v, str) and v), "error")
    return ErrorEvent(error_status(body), body, kind)


def _choice_is_content(choice: object) -> bool:
    if not isinstance(choice, Mapping):
        return True
    if choice.get("finish_reason") is not None or choice.get("text") not in _EMPTY:
        return True
    delta = choice.get("delta")
    if not isinstance(delta, Mapping):
        return False
    return any(key != "role" and value not in _EMPTY for key, value in delta.items())


def classify_event(event: str | None, data: str) -> ErrorEvent | bool:
    """An error event, True for content, False for an event that comes before content."""
    if data == "[DONE]":
        return True
    try:
        body: object = json.loads(data)
    except ValueError:
        body = None
    if event == "error":
        if not isinstance(body, Mapping):
            body = {"error": {"message": data, "type": "error"}}
        return _error_event(body)
    if event in _ANTHROPIC_OPENING or event in _RESPONSES_OPENING:
        return False
    if not isinstance(body, Mapping):
        return True
    kind = body.get("type")
    if kind == "error" or (body.get("error") not in _EMPTY and "choices" not in body):
        return _error_event(body)
    if kind == "response.failed":
        response = body.get("response")
        failure = response.get("error") if isinstance(response, Mapping) else None
        return _error_event({"error": failure if isinstance(failure, Mapping) else {"type": kind}})
    if kind in _ANTHROPIC_OPENING or kind in _RESPONSES_OPENING:
        return False
    if kind == "content_block_start":
        block = body.get("content_block")
        return not (isinstance(block, Mapping) and block.get("type") == "text" and not block.get("text"))
    if "choices" in body:
        choices = body.get("choices")
        if not choices:
            return body.get("usage") is not None
        return not isinstance(choices, list) or any(_choice_is_content(c) for c in choices)
    return True


class StreamStart:
    """Reads server-sent events from the bytes fed to it until the first content or error.

    `feed` answers None while only events that come before content have been seen, True
    at the first content (or after `MAX_OPENING` bytes), or the `ErrorEvent` that came first.
    """

    __slots__ = ("_data", "_event", "_pending", "_seen")

    def __init__(self) -> None:
        self._pending = b""
        self._event: str | None = None
        self._data: list[str] = []
        self._seen = 0

    def feed(self, chunk: bytes) -> ErrorEvent | bool | None:
        self._seen += len(chunk)
        if self._seen > MAX_OPENING:
            return True
        pending = self._pending + chunk
        lines = pending.splitlines(keepends=True)
        # A line is complete at its end of line; a final "\r" may be half of "\r\n".
        if lines and (not lines[-1].endswith((b"\n", b"\r")) or lines[-1].endswith(b"\r")):
            self._pending = lines.pop()
        else:
            self._pending = b""
        for raw in lines:
            line = raw.rstrip(b"\r\n").decode("utf-8", "replace")
            verdict = self._line(line)
            if verdict is not None:
                return verdict
        return None

    def _line(self, line: str) -> ErrorEvent | bool | None:
        if not line:
            event, data = self._event, self._data
            self._event, self._data = None, []
            if not data:
                return None
            verdict = classify_event(event, "\n".join(data))
            return None if verdict is False else verdict
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None


def opens_stream(response: Any) -> bool:
    """Whether the transport reads this answer's opening: a 200 event stream."""
    return response.status_code == 200 and is_event_stream(response)


def error_response(response: Any, error: ErrorEvent) -> tuple[Any, bytes]:
    """An answer with ``error``'s status and body in place of the stream (and the body)."""
    body = json.dumps(error.body).encode()
    headers = [
        (name, value)
        for name, value in response.headers.items()
        if name.lower() not in ("content-type", "content-length", "content-encoding", "transfer-encoding")
    ]
    headers.append(("content-type", "application/json"))
    made_of = f"{error.kind} event before any content of a 200 event stream"
    extensions = {**response.extensions, STREAM_ERROR_KEY: made_of}
    return type(response)(error.status, headers=headers, content=body, extensions=extensions), body


def ended_error(request: Any, message: str = "the event stream ended before any content") -> Exception:
    """The HTTP library's RemoteProtocolError (a connection error) for a stream that ended too soon."""
    library = sys.modules.get(type(request).__module__.split(".", 1)[0])
    error = getattr(library, "RemoteProtocolError", None)
    if isinstance(error, type) and issubclass(error, Exception):
        made: Exception = error(message, request=request)  # type: ignore[call-arg]
        return made
    return ConnectionError(message)


def close_iterated(rest: Any, owner: Any) -> None:
    """Close the iterator ``rest`` of a stream (a generator left suspended), then ``owner``
    (the stream or its response)."""
    try:
        close = getattr(rest, "close", None)
        if close is not None:
            close()
    finally:
        owner.close()


async def aclose_iterated(rest: Any, owner: Any) -> None:
    """`close_iterated` for an async iterator and stream."""
    try:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
    finally:
        await owner.aclose()


def open_sync(
    request: Any,
    response: Any,
    begin: Callable[[], None] | None,
    expires: float | None,
    clock: Callable[[], float],
    flavor: Flavor,
) -> tuple[Any, bytes | None]:
    """Read a 200 event stream up to its first content: ``(response, None)`` with its stream
    replaced by ``flavor.replayed_stream(head, rest, stream)``, or the answer `error_response`
    makes of an error event. A stream that ends or breaks before content raises (closed); so
    does one past ``expires`` (`bodies.DeadlinePassedError`), checked between chunks.
    ``begin`` (`attempt_core.Send.begin`) is called before the body is read."""
    if begin is not None:
        begin()
    replayed = flavor.replayed_stream
    stream = response.stream
    start = StreamStart()
    head: list[bytes] = []
    rest: Iterator[bytes] | None = None
    try:
        rest = iter(stream)
        for chunk in rest:
            head.append(chunk)
            verdict = start.feed(chunk)
            if verdict is True:
                response.stream = replayed(b"".join(head), rest, stream)
                return response, None
            if isinstance(verdict, ErrorEvent):
                close_iterated(rest, response)
                return error_response(response, verdict)
            if expires is not None and clock() > expires:
                raise DeadlinePassedError
    except BaseException:
        close_iterated(rest, response)
        raise
    close_iterated(rest, response)
    raise ended_error(request)


async def open_async(
    request: Any, response: Any, begin: Callable[[], None] | None, flavor: Flavor
) -> tuple[Any, bytes | None]:
    """`open_sync` for an async stream; the attempt's hard bound is the caller's."""
    if begin is not None:
        begin()
    replayed = flavor.replayed_stream
    stream = response.stream
    start = StreamStart()
    head: list[bytes] = []
    rest: AsyncIterator[bytes] | None = None
    try:
        rest = stream.__aiter__()
        async for chunk in rest:
            head.append(chunk)
            verdict = start.feed(chunk)
            if verdict is True:
                response.stream = replayed(b"".join(head), rest, stream)
                return response, None
            if isinstance(verdict, ErrorEvent):
                await aclose_iterated(rest, response)
                return error_response(response, verdict)
    except BaseException:
        await aclose_iterated(rest, response)
        raise
    await aclose_iterated(rest, response)
    raise ended_error(request)
