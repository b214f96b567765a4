"""The proxy's front: one ASGI endpoint for every path of the engine's API the shim serves.

For each request: the intake (intake.py) checks its head, in one order shared with the
refusal from the head (route table: a path no row names is a 404, an operator route not
allowed is a 403, and a ``/v1/`` path must stay under ``/v1/`` after normalisation, so only
the configured upstream's API is ever reachable; then key, headers, size), the body is read
and checked, a generation request passes the admission gate (gate.py: every refusal for load
is its), and the relay (relay.py) forwards method, path, query, headers (Authorization
included; hop-by-hop stripped) and body and streams the answer back. The proxy itself only
moves ASGI messages and writes the access log.

Raw ASGI rather than a Starlette ``StreamingResponse`` because the proxy must watch
the client's connection the whole time (disconnect.py): a disconnect while queued gives
the queue place back at once, a disconnect mid-response aborts the upstream request (its
socket is closed, so the engine sees the abort) and frees the slot. The slot is given
back in ``finally`` on every path.

Choices where the protocol is silent: only POSTs to the table's ``engine`` routes are
admission-controlled (intake.py), counted in the ``requests_total`` metric and carry
``x-queue-time-ms``; the shim's own errors take the route's error shape (Anthropic's on
``/v1/messages``, rejection.py). What the relay makes of upstream failures and 503s: relay.py
and gate.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.http.coarse_timers import CoarseTimers
from llm_backoff_shim.http.interface import (
    CLIENT_WIRE,
    CONNECTION_GONE,
    ClientWire,
    ConnectionGone,
)
from llm_backoff_shim.serve.api.rejection import Refusal, wire_form
from llm_backoff_shim.serve.api.routes import ROUTES, Kind, Route, RouteTable, Shape, stays_under_v1
from llm_backoff_shim.serve.observe.access_log import AccessLog, AccessRecord, request_id_of
from llm_backoff_shim.serve.request_path.disconnect import watch_disconnect
from llm_backoff_shim.serve.request_path.exchange import (
    VIA,
    Admitted,
    ClientGone,
    Clock,
    Exchange,
    ForwardRequest,
    Head,
    Receive,
    Scope,
    Send,
    UpstreamRefused,
    answer,
)
from llm_backoff_shim.serve.request_path.headers import Forwarding, RawHeaders

log = logging.getLogger("llm_backoff_shim.proxy")

#: POST to these paths goes through admission (the ``engine`` rows of routes.py).
GENERATION_PATHS: frozenset[str] = frozenset(r.path for r in ROUTES if r.kind is Kind.ENGINE)
_DEFAULT_ROUTES = RouteTable()

#: Distinct answers to requests refused from their heads kept for reuse (_head_answer).
_HEAD_ANSWERS_MAX = 512


def is_allowed_path(path: str) -> bool:
    """Whether ``path`` (percent-decoded) stays under ``/v1/``: no dot segments, no backslashes."""
    return stays_under_v1(path)


def is_generation(method: str, path: str) -> bool:
    """Whether a request to ``path`` goes through admission (with the default route table)."""
    route = _DEFAULT_ROUTES.lookup(path)
    return method == "POST" and route is not None and route.admitted


# What the proxy asks of each of its steps. app.py hands it the steps built (intake.py,
# gate.py, relay.py, the metrics); the proxy names only what it calls, so what the steps
# stand on (decide/, the policies, the upstream client) is theirs alone.


class IntakeStep(Protocol):
    """The checks on what the client sends (:class:`~llm_backoff_shim.serve.request_path.intake.Intake`)."""

    @property
    def body_timers(self) -> CoarseTimers | None: ...

    def head(self, method: str, path: str, headers: RawHeaders) -> Head | Refusal: ...

    async def read(self, head: Head, receive: Receive, task: asyncio.Task[Any] | None) -> bytes | Refusal: ...

    def body(
        self, head: Head, body: bytes
    ) -> tuple[AdmissionRequest | None, dict[str, Any] | None] | Refusal: ...


class GatePassage(Admitted, Protocol):
    """A generation request's way through the gate
    (:class:`~llm_backoff_shim.serve.request_path.gate.Passage`)."""

    @property
    def forward(self) -> ForwardRequest: ...

    async def enter(self, exchange: Exchange) -> Refusal | None: ...

    async def leave(self, exchange: Exchange) -> None: ...


class GateStep(Protocol):
    """Every refusal for load (:class:`~llm_backoff_shim.serve.request_path.gate.AdmissionGate`)."""

    @property
    def hooks(self) -> object: ...

    def may_refuse_at_once(self) -> bool: ...

    def refuse_at_once(self, request: AdmissionRequest) -> Refusal | None: ...

    def passage(self, request: AdmissionRequest, forward: ForwardRequest) -> GatePassage: ...

    def engine_refused(self, refused: UpstreamRefused, cls: str | None, exchange: Exchange) -> Refusal: ...


class RelayStep(Protocol):
    """The request upstream, its answer back (:class:`~llm_backoff_shim.serve.request_path.relay.Relay`)."""

    async def __call__(
        self,
        forward: ForwardRequest,
        send: Send,
        admitted: Admitted | None,
        exchange: Exchange | None,
        arrival: float,
        wire: ClientWire | None = None,
    ) -> UpstreamRefused | None: ...


class Counts(Protocol):
    """What the proxy counts itself (:class:`~llm_backoff_shim.serve.observe.metrics.ShimMetrics`)."""

    def bad_request(self, reason: str) -> None: ...

    def count(self, cls: str, outcome: str) -> None: ...


class Proxy:
    """ASGI app relaying ``/v1/...`` to the upstream through admission."""

    def __init__(
        self,
        *,
        intake: IntakeStep,
        gate: GateStep,
        relay: RelayStep,
        metrics: Counts,
        clock: Clock,
        access_log: AccessLog | None = None,
        forwarding: Forwarding | None = None,
    ) -> None:
        # The checks on what the client sends (intake.py); every refusal for load (gate.py).
        self.intake = intake
        self.gate = gate
        self.relay = relay
        self.metrics = metrics
        self.clock = clock
        self.access_log = access_log
        # Who the client is, said to the upstream by the shim (headers.py says why).
        self.forwarding = forwarding if forwarding is not None else Forwarding()
        # The loop the proxy serves: one at a time, as its upstream connections belong to one.
        self._loop: asyncio.AbstractEventLoop | None = None
        # Answers written from requests' heads, by what they are made of (_head_answer).
        self._head_answers: dict[tuple[object, ...], tuple[int, bytes]] = {}

    def _current_task(self) -> asyncio.Task[Any]:
        """The request's task, found without ``asyncio.get_running_loop()``.

        On Python 3.11 that call costs a getpid() syscall (asyncio's fork check), and the
        relay needed it two to four times per request: about 5 % of its CPU here.
        """
        loop = self._loop
        task = asyncio.current_task(loop) if loop is not None else None
        if task is None:
            loop = self._loop = asyncio.get_running_loop()
            task = asyncio.current_task(loop)
            assert task is not None
        return task

    @property
    def hooks(self) -> object:
        """The request hooks the intake and the gate ask (app.py hands both the same)."""
        return self.gate.hooks

    @property
    def body_timers(self) -> CoarseTimers | None:
        """The intake's one timer for every request's body (the serving path arms it too, for a
        body it reads past after a refusal from the head)."""
        return self.intake.body_timers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        arrival = self.clock()
        path: str = scope["path"]
        method: str = scope["method"]
        record = self._record(scope, method, path, arrival)
        head = self.intake.head(method, path, list(scope["headers"]))
        if isinstance(head, Refusal):
            await self._refuse(send, head, record)
            return
        task = self._current_task()
        try:
            body = await self.intake.read(head, receive, task)
        except ClientGone:
            if head.request is not None:
                # Counted, so that every generation request the shim saw has an outcome.
                self.metrics.count(head.request.cls, "client_disconnected")
            self._log(record, Exchange())
            return  # the client left before sending its whole request
        if record is not None:
            record.body_done = self.clock()
        if isinstance(body, Refusal):
            await self._refuse(send, body, record)
            return
        checked = self.intake.body(head, body)
        if isinstance(checked, Refusal):
            await self._refuse(send, checked, record)
            return
        request, data = checked
        route = head.route
        forward = ForwardRequest(
            method=method,
            path=path,
            target=_target(scope, path, route),
            headers=[*self.forwarding.request_headers(head.headers, _peer(scope)), VIA],
            body=body,
            parsed=data,
        )
        extensions = scope.get("extensions")
        gone = extensions.get(CONNECTION_GONE) if extensions else None
        wire = extensions.get(CLIENT_WIRE) if extensions else None
        if request is None:
            exchange = Exchange(shape=route.shape)

            async def relay() -> None:
                refused = await self.relay(forward, send, None, exchange, arrival, wire)
                if refused is not None:
                    await answer(send, self.gate.engine_refused(refused, None, exchange), exchange)

            try:
                await watch_disconnect(task, receive, relay, gone)
            finally:
                self._log(record, exchange)
        else:
            await self._gated(request, forward, receive, send, arrival, task, record, gone, wire, route.shape)

    def refuse_from_head(self, scope: Scope) -> bytes | None:
        """The whole answer to a generation request refused as soon as its head is parsed, or
        None: then nothing was done, and the request takes the usual path.

        Why: under a burst every refusal costs the shim its whole request path (a task, the
        body read and parsed, the ASGI messages), about 0.2 ms of CPU each, and a burst of a
        few hundred requests then waits tens of ms for its answers. A refusal that cannot
        depend on the body (every slot taken, no place in the class's queue:
        :meth:`AdmissionController.refuse_at_once`) is decided and written from the head, as a
        front proxy's connection or rate limit refuses; the serving protocol then reads the
        body past (relay_protocol.py).

        Anything else takes the usual path, so its answer does not change: a request the
        intake would refuse (:meth:`Intake.head`, the same checks as the usual path's), or one
        the gate will not refuse from its head (:meth:`AdmissionGate.refuse_at_once`). A
        malformed body of a refused request is not seen: its 400 comes when the retry is
        admitted, as behind any front proxy that limits before it parses.
        """
        method: str = scope["method"]
        path: str = scope["path"]
        gate = self.gate
        if method != "POST" or not gate.may_refuse_at_once():
            return None
        headers: RawHeaders = scope["headers"]
        head = self.intake.head(method, path, headers)
        if isinstance(head, Refusal) or head.request is None:
            return None
        request = head.request
        arrival = self.clock()
        response = gate.refuse_at_once(request)
        if response is None:
            return None
        status, answer = self._head_answer(response, head.route.shape)
        access_log = self.access_log
        if access_log is not None and access_log.enabled:
            # The line _log would write for this refusal, its record built in one go (by
            # position, in AccessRecord's order: a third of the cost of naming 13 fields).
            tenant = request.tenant
            access_log.write(
                AccessRecord(
                    method,
                    path,
                    arrival,
                    request.cls,
                    None if tenant == "-" else tenant,
                    "rejected",  # outcome
                    response.reason,  # the rejection's code
                    status,
                    None,  # body_done
                    0.0,  # queue_time
                    None,  # upstream_start
                    None,  # first_byte
                    None,  # upstream_end
                    response.retry_after,
                    response.detail,
                    request_id_of(headers),
                    _peer(scope),  # client
                )
            )
        return answer

    def _head_answer(self, response: Refusal, shape: Shape) -> tuple[int, bytes]:
        """:func:`wire_form` of ``response``, remembered by value: refusals from the head repeat
        (the same few hints, codes and headers)."""
        key = (shape, response.status, response.body, *response.headers)
        known = self._head_answers.get(key)
        if known is None:
            known = wire_form(response, shape)
            if len(self._head_answers) >= _HEAD_ANSWERS_MAX:
                self._head_answers.clear()
            self._head_answers[key] = known
        return known

    async def _refuse(self, send: Send, refusal: Refusal, record: AccessRecord | None) -> None:
        self.metrics.bad_request(refusal.reason)
        exchange = Exchange(metric="bad_request", code=refusal.reason, shape=refusal.shape)
        await answer(send, refusal, exchange)
        self._log(record, exchange)

    def _record(self, scope: Scope, method: str, path: str, arrival: float) -> AccessRecord | None:
        if self.access_log is None or not self.access_log.enabled:
            return None
        return AccessRecord(
            method=method,
            path=path,
            arrival=arrival,
            request_id=request_id_of(scope["headers"]),
            client=_peer(scope),
        )

    def _log(
        self,
        record: AccessRecord | None,
        exchange: Exchange,
        cls: str | None = None,
        tenant: str | None = None,
    ) -> None:
        if record is None or self.access_log is None:
            return
        record.cls, record.tenant = cls, None if tenant in (None, "-") else tenant
        record.outcome, record.code, record.status = exchange.metric, exchange.code or None, exchange.sent
        record.queue_time, record.retry_after = exchange.queue_time, exchange.retry_after
        record.detail = exchange.detail
        record.upstream_start, record.first_byte = exchange.upstream_start, exchange.first_byte
        record.upstream_end = exchange.upstream_end
        self.access_log.write(record)

    async def _gated(
        self,
        request: AdmissionRequest,
        forward: ForwardRequest,
        receive: Receive,
        send: Send,
        arrival: float,
        task: asyncio.Task[Any],
        record: AccessRecord | None = None,
        gone: ConnectionGone | None = None,
        wire: ClientWire | None = None,
        shape: Shape = Shape.OPENAI,
    ) -> None:
        exchange = Exchange(shape=shape)
        gate = self.gate
        passage = gate.passage(request, forward)

        async def work() -> None:
            refusal = await passage.enter(exchange)
            if refusal is not None:
                await answer(send, refusal, exchange)
                return
            refused = await self.relay(passage.forward, send, passage, exchange, arrival, wire)
            if refused is not None:
                await answer(send, gate.engine_refused(refused, request.cls, exchange), exchange)

        try:
            await watch_disconnect(task, receive, work, gone)
        finally:
            await passage.leave(exchange)
            self._log(record, exchange, request.cls, request.tenant)


def _target(scope: Scope, path: str, route: Route) -> bytes:
    raw: bytes = scope.get("raw_path") or path.encode()
    if route.upstream_path is not None:
        raw = route.upstream_path.encode()
    query: bytes = scope.get("query_string", b"")
    return raw + b"?" + query if query else raw


def _peer(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None
