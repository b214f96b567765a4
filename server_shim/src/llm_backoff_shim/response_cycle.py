"""uvicorn's request/response cycle, writing a response's head in the same write as its first body bytes.

uvicorn writes the status line and headers as soon as the app sends
``http.response.start``, and the body with the next message: two socket writes for a
response that is ready all at once. On loopback each write runs the whole TCP path,
and the client handles one more segment. With the head held back a relayed request
costs the shim two writes instead of three (strace), and a 429 one instead of two;
paired runs put the saving at a few microseconds of CPU per request (under this
machine's run-to-run noise; docs/benchmarks.md).

The app says when holding the head back is safe: a start message carrying
``BODY_FOLLOWS: True`` promises that a body message follows at once (the relay sets it
when the body is already there, error answers always do). Without the key, or under
another server, nothing changes: an unknown key in an ASGI message is ignored. A
stream's headers are never held, since its first token may be seconds away.

Everything else is uvicorn's own ``send`` (header checks, framing, keep-alive, flow
control): only the transport it writes to is swapped for the duration of the call.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

#: Key of an ``http.response.start`` message: a body message follows at once.
BODY_FOLLOWS = "llm_backoff.body_follows"


class _Capture:
    """Stands in for the transport while uvicorn writes a head that is held back."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class _HeadFirst:
    """Stands in for the transport while uvicorn writes the first body bytes: the head goes with them."""

    __slots__ = ("head", "real")

    def __init__(self, real: Any, head: bytes) -> None:
        self.real = real
        self.head = head

    def write(self, data: bytes) -> None:
        head, self.head = self.head, b""
        self.real.write(head + data)

    def close(self) -> None:
        self.flush()
        self.real.close()

    def flush(self) -> None:
        if self.head:
            head, self.head = self.head, b""
            self.real.write(head)


class CoalescingCycle(RequestResponseCycle):
    """uvicorn's httptools cycle; a held response head is written with the first body bytes."""

    _held: bytes | None = None

    async def send(self, message: Any) -> None:
        held = self._held
        if held is not None:
            self._held = None
            real = self.transport
            first = _HeadFirst(real, held)
            self.transport = first  # type: ignore[assignment]  # only write/close are used by send
            try:
                await super().send(message)
            finally:
                self.transport = real
                first.flush()  # uvicorn raised before writing: the head still goes out
            return
        if (
            message.get(BODY_FOLLOWS)
            and message["type"] == "http.response.start"
            and not self.response_started
        ):
            real = self.transport
            capture = _Capture()
            self.transport = capture  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                self.transport = real
            self._held = capture.data
            return
        await super().send(message)

    def flush_head(self) -> None:
        """Write a held head now (before writing around ``send``, as the relay's direct path does)."""
        held = self._held
        if held is not None:
            self._held = None
            self.transport.write(held)
