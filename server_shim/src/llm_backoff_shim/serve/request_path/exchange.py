"""What one request carries between the proxy's front and its steps (the intake, the admission
gate, the relay): the forwarded request, what came of it (for the slot's release, the metrics
and the access log), and the two events the steps report (the client gone, the upstream's
refusal)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Outcome, Rejection
from llm_backoff_shim.http.interface import BODY_FOLLOWS
from llm_backoff_shim.serve.api.rejection import Refusal, in_shape
from llm_backoff_shim.serve.api.routes import Route, Shape
from llm_backoff_shim.serve.request_path.headers import RawHeaders

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Clock = Callable[[], float]

#: RFC 9110 section 7.6.3: a proxy adds itself to ``Via`` in each message it forwards.
VIA = (b"via", b"1.1 llm-backoff-shim")


@dataclass(frozen=True, slots=True)
class Head:
    """A request whose head passed the intake: its route and headers, and for a generation
    request (a POST to an ``engine`` route) the admission request its headers make."""

    route: Route
    headers: RawHeaders
    request: AdmissionRequest | None


class ClientGone(Exception):  # noqa: N818 - an event, not an error of ours
    """The client disconnected before its body was complete."""


@dataclass(slots=True)
class Exchange:
    """What the relay learned, for slot release and metrics."""

    status: int | None = None
    outcome: Outcome = Outcome.ABORTED
    metric: str = "client_disconnected"
    code: str = ""
    retry_after: float | None = None
    #: The error shape of the shim's own answers on this route.
    shape: Shape = Shape.OPENAI
    # For the access log: the status the client got, why a rejection, and where the time went.
    detail: str | None = None
    sent: int | None = None
    queue_time: float | None = None
    upstream_start: float | None = None
    first_byte: float | None = None
    upstream_end: float | None = None
    #: Completion tokens of an answer relayed (in full, or until its client closed it), when
    #: counted (answer_meter.py).
    answer_tokens: int | None = None

    def reject(self, rejection: Rejection, outcome: Outcome = Outcome.ABORTED) -> None:
        """Record that the shim turned the request away with ``rejection``."""
        self.outcome, self.metric = outcome, "rejected"
        self.code, self.retry_after, self.detail = rejection.code, rejection.retry_after, rejection.message


class ForwardRequest(NamedTuple):
    # A named tuple: built once per request, and a frozen dataclass's __init__ costs several times more.
    method: str
    path: str
    #: The percent-encoded path and query, as the client sent them (already validated).
    target: bytes
    headers: RawHeaders
    body: bytes
    #: The body as parsed at intake (generation requests), for hooks that read it.
    parsed: dict[str, Any] | None = None


class Admitted(Protocol):
    """A request that holds a slot, as the relay sees it (the admission gate's passage)."""

    @property
    def cls(self) -> str: ...

    def answer_headers(self) -> RawHeaders:
        """What the shim adds to the upstream's answer: its queue time, the hooks' headers."""
        ...

    def observer(self) -> Callable[[bytes], None] | None:
        """What reads each chunk of the answer (the hooks' usage count), None when nothing does."""
        ...

    def first_body_byte(self) -> None:
        """The answer's first body byte arrived: admission learns the time to it."""
        ...


@dataclass(frozen=True, slots=True)
class UpstreamRefused:
    """The upstream could not serve the request and nothing was sent to the client: the
    admission gate makes the refusal. ``overloaded``: it answered 503 for an admitted request
    (else it was unreachable, or answered 503 to a request that was not admitted)."""

    detail: str
    overloaded: bool = False


async def answer(send: Send, response: Refusal, exchange: Exchange | None = None) -> None:
    """Send ``response`` whole through ASGI, in ``exchange``'s error shape, noting the status sent."""
    if exchange is not None and exchange.shape is not Shape.OPENAI:
        response = in_shape(response, exchange.shape)
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": response.headers,
            BODY_FOLLOWS: True,
        }
    )
    if exchange is not None:
        exchange.sent = response.status
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


def classify(exchange: Exchange, status: int) -> None:
    if 200 <= status < 300:
        exchange.outcome, exchange.metric = Outcome.COMPLETED, "completed"
    elif status >= 500:
        exchange.outcome, exchange.metric = Outcome.UPSTREAM_ERROR, "upstream_error"
    else:
        # Relayed as sent, but a quick 4xx says nothing about how long generation takes.
        exchange.outcome, exchange.metric = Outcome.CLIENT_ERROR, "completed"
