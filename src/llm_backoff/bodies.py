"""Response bodies: which are read inside the attempt, and how the others are watched.

JSON bodies and error bodies are read inside the attempt (`must_buffer`), so a
connection that drops half-way through a JSON answer counts as a failed attempt and is
retried, and an error body can be read for hints and ``insufficient_quota``. Per-read
timeouts alone let a body that trickles in (a byte just inside each read timeout)
stretch a call without end, so a sync read also checks the deadline between chunks
(`read_sync`); an async attempt runs under a hard bound instead (see the engine).

Other bodies (server-sent events, audio, file downloads) are passed through unread:
once such a response has started, a failure is the caller's to see and is never
retried, so no output is ever duplicated. Such a body is wrapped in a stream of the
caller's HTTP library that reports to a `StreamGuard`: an error while it is read gets
the call's attempt history, and with a limiter the tail of an event stream (where
``usage`` is) goes to the permit (`TailRecorder`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from ._reach import content_type
from .attempts import annotate
from .limits import Permit, settle_quietly

__all__ = [
    "MAX_SETTLE_BODY",
    "SSE_TAIL",
    "DeadlinePassedError",
    "Flavor",
    "StreamGuard",
    "TailRecorder",
    "buffer_async",
    "deadline_error",
    "decoded",
    "is_event_stream",
    "must_buffer",
    "read_sync",
]

#: JSON bodies above this are not handed to ``permit.settle`` (they are not chat completions).
MAX_SETTLE_BODY = 8 * 1024 * 1024
#: How much of a server-sent-event stream ``permit.settle`` sees: the end, where ``usage`` is.
SSE_TAIL = 64 * 1024


class AttemptResponse(Protocol):
    """What the retry loop needs of an httpx/httpx2 ``Response``."""

    status_code: int
    headers: MutableMapping[str, str]
    extensions: dict[str, Any]
    stream: Any

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Flavor:
    """What differs between httpx and httpx2: the classes of streams we hand back."""

    byte_stream: Callable[[bytes], Any]
    guarded_stream: Callable[[Any, StreamGuard], Any]
    replayed_stream: Callable[[bytes, Any, Any], Any]
    """``(head, rest, stream)``: the bytes read of ``stream``, then the rest of its iterator."""


def _media_type(response: AttemptResponse) -> str:
    return content_type(response.headers).split(";", 1)[0].strip().lower()


def _is_json(response: AttemptResponse) -> bool:
    media = _media_type(response)
    return media == "application/json" or media.endswith("+json")


def is_event_stream(response: AttemptResponse) -> bool:
    return _media_type(response) == "text/event-stream"


def must_buffer(response: AttemptResponse) -> bool:
    """Whether the body is read inside the attempt: error bodies and JSON."""
    return response.status_code >= 400 or _is_json(response)


def decoded(response: AttemptResponse, raw: bytes) -> bytes | None:
    """The body after content-encoding (gzip, br...) is undone; None if it cannot be."""
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return raw
    try:
        scratch = type(response)(response.status_code, headers=response.headers, content=raw)  # type: ignore[call-arg]
        return bytes(scratch.read())  # type: ignore[attr-defined]
    except Exception:
        return None


def deadline_error(
    request: Any, message: str = "the call's deadline passed while the response was still arriving"
) -> Exception:
    """The HTTP library's own ReadTimeout, so classification and openai treat it as any timeout."""
    library = sys.modules.get(type(request).__module__.split(".", 1)[0])
    error = getattr(library, "ReadTimeout", None)
    if isinstance(error, type) and issubclass(error, Exception):
        made: Exception = error(message, request=request)  # type: ignore[call-arg]
        return made
    return TimeoutError(message)


class DeadlinePassedError(Exception):
    """`read_sync` passed ``expires``; the caller raises `deadline_error` for its request."""


def read_sync(
    stream: Any, expires: float | None = None, clock: Callable[[], float] = time.monotonic
) -> bytes:
    """The whole of a sync body (the stream is closed); `DeadlinePassedError` past ``expires``.

    The deadline is checked between chunks: per-read timeouts alone let a body that
    trickles in stretch the call without end.
    """
    chunks: list[bytes] = []
    try:
        for chunk in stream:
            chunks.append(chunk)
            if expires is not None and clock() > expires:
                raise DeadlinePassedError
        return b"".join(chunks)
    finally:
        stream.close()


async def buffer_async(response: Any, flavor: Flavor) -> bytes | None:
    """Read a body we must see (JSON, errors) inside the attempt; None for one passed through."""
    if response.status_code < 400 and not _is_json(response):
        return None
    stream = response.stream
    try:
        raw = b"".join([chunk async for chunk in stream])
    finally:
        await stream.aclose()
    # A stream of the kind we would build (a mock's, or one httpx buffered) replays the same
    # bytes already: building another costs a per-call allocation for nothing.
    if type(stream) is not flavor.byte_stream:
        response.stream = flavor.byte_stream(raw)
    return raw


class TailRecorder:
    """Keeps the last `SSE_TAIL` bytes of a stream and settles the permit once, on close."""

    def __init__(self, permit: Permit, status: int) -> None:
        self._permit = permit
        self._status = status
        self._tail = bytearray()
        self._settled = False

    def feed(self, chunk: bytes) -> None:
        self._tail += chunk
        if len(self._tail) > 2 * SSE_TAIL:  # trim rarely: amortised O(1) per byte
            del self._tail[: len(self._tail) - SSE_TAIL]

    def settle(self) -> None:
        if not self._settled:
            self._settled = True
            settle_quietly(self._permit, self._status, bytes(self._tail[-SSE_TAIL:]))


class StreamGuard:
    """Watches a response body we passed through unread (events, downloads) while it is read.

    An error while reading it (the connection drops mid-stream) is raised as it is, never
    retried (the caller may have used part of the output), but carries the call's attempt
    history and a note like any final error. With a limiter, ``recorder`` keeps the tail
    of an event stream for the permit.
    """

    __slots__ = ("_attempts", "_status", "recorder")

    def __init__(self, attempts: tuple[Any, ...], status: int, recorder: TailRecorder | None) -> None:
        self._attempts = attempts
        self._status = status
        self.recorder = recorder

    def broke(self, exc: BaseException) -> None:
        annotate(
            exc,
            self._attempts,
            f"the response (status {self._status}) broke off after it had started; "
            "not retried, so no output is duplicated",
        )

    def closed(self) -> None:
        if self.recorder is not None:
            self.recorder.settle()
