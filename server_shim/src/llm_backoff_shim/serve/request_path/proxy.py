"""The proxy's front: one ASGI endpoint for every path of the engine's API the shim serves.

For each request: the intake (intake.py) checks its head, in one order shared with the
refusal from the head (route table: a path no row names is a 404, an operator route not
allowed is a 403, and a ``/v1/`` path must stay under ``/v1/`` after normalisation, so only
the configured upstream's API is ever reachable; then key, headers, size), the body is read
and checked, a generation request takes a slot through admission, and the relay (relay.py)
forwards method, path, query, headers (Authorization included; hop-by-hop stripped) and body
and streams the answer back.

Raw ASGI rather than a Starlette ``StreamingResponse`` because the proxy must watch
the client's connection the whole time (disconnect.py): a disconnect while queued gives
the queue place back at once, a disconnect mid-response aborts the upstream request (its
socket is closed, so the engine sees the abort) and frees the slot. The slot is given
back in ``finally`` on every path.

Choices where the protocol is silent: only POSTs to the table's ``engine`` routes are
admission-controlled (intake.py), counted in the ``requests_total`` metric and carry
``x-queue-time-ms``; the shim's own errors take the route's error shape (Anthropic's on
``/v1/messages``, rejection.py). What the relay makes of upstream failures and 503s: relay.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.retry_after import OutageClock
from llm_backoff_shim.decide.tickets import Outcome, Rejection
from llm_backoff_shim.http.coarse_timers import CoarseTimers
from llm_backoff_shim.http.interface import (
    CLIENT_WIRE,
    CONNECTION_GONE,
    ClientWire,
    ConnectionGone,
)
from llm_backoff_shim.serve.observe.access_log import AccessLog, AccessRecord, request_id_of
from llm_backoff_shim.serve.observe.metrics import ShimMetrics
from llm_backoff_shim.serve.policy.fleet_hints import FleetHints
from llm_backoff_shim.serve.policy.request_hooks import RequestHooks
from llm_backoff_shim.serve.request_path.auth import ApiKeys
from llm_backoff_shim.serve.request_path.disconnect import watch_disconnect
from llm_backoff_shim.serve.request_path.exchange import (
    VIA,
    Clock,
    Exchange,
    ForwardRequest,
    Receive,
    Scope,
    Send,
)
from llm_backoff_shim.serve.request_path.headers import Forwarding, RawHeaders
from llm_backoff_shim.serve.request_path.intake import ClientGone, Intake
from llm_backoff_shim.serve.request_path.rejection import Refusal, answer, rejection_response, wire_form
from llm_backoff_shim.serve.request_path.relay import Relay, UpstreamRefused
from llm_backoff_shim.serve.request_path.routes import ROUTES, Kind, Route, RouteTable, Shape, stays_under_v1
from llm_backoff_shim.serve.request_path.upstream import UpstreamClient
from llm_backoff_shim.serve.request_path.waiting import AsyncAdmission, Grant

log = logging.getLogger("llm_backoff_shim.proxy")

#: POST to these paths goes through admission (the ``engine`` rows of routes.py).
GENERATION_PATHS: frozenset[str] = frozenset(r.path for r in ROUTES if r.kind is Kind.ENGINE)
_DEFAULT_ROUTES = RouteTable()

#: Larger request bodies get a 413 instead of being buffered (``--max-body-bytes``).
MAX_BODY_BYTES = 8 * 1024 * 1024

#: Distinct answers to requests refused from their heads kept for reuse (_head_answer).
_HEAD_ANSWERS_MAX = 512


def is_allowed_path(path: str) -> bool:
    """Whether ``path`` (percent-decoded) stays under ``/v1/``: no dot segments, no backslashes."""
    return stays_under_v1(path)


def is_generation(method: str, path: str) -> bool:
    """Whether a request to ``path`` goes through admission (with the default route table)."""
    route = _DEFAULT_ROUTES.lookup(path)
    return method == "POST" and route is not None and route.admitted


class Proxy:
    """ASGI app relaying ``/v1/...`` to the upstream through admission."""

    def __init__(
        self,
        *,
        upstream: UpstreamClient,
        admission: AsyncAdmission,
        metrics: ShimMetrics,
        reject_status: int,
        clock: Clock,
        api_keys: ApiKeys | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        body_timeout: float | None = None,
        hooks: RequestHooks | None = None,
        on_first_byte: Callable[[float, int], None] | None = None,
        access_log: AccessLog | None = None,
        routes: RouteTable | None = None,
        forwarding: Forwarding | None = None,
        fleet_hints: FleetHints | None = None,
        request_start: bool = True,
    ) -> None:
        self.access_log = access_log
        # The fleet's Retry-After for an admission refusal (fleet_hints.py); none: this replica's.
        self.fleet_hints = fleet_hints
        self.routes = routes if routes is not None else _DEFAULT_ROUTES
        # Who the client is, said to the upstream by the shim (headers.py says why).
        self.forwarding = forwarding if forwarding is not None else Forwarding()
        # Classes by tenant, quotas, SLO headers, vLLM priority; none by default.
        self.hooks = hooks if hooks is not None else RequestHooks()
        self.api_keys = api_keys if api_keys is not None else ApiKeys(())
        self.upstream = upstream
        self.admission = admission
        self.metrics = metrics
        self.reject_status = reject_status
        self.clock = clock
        estimates = admission.controller.estimator.config
        self.intake = Intake(
            routes=self.routes,
            api_keys=self.api_keys,
            hooks=self.hooks,
            controller=admission.controller,
            max_body_bytes=max_body_bytes,
            body_timeout=body_timeout,
            request_start=request_start,
        )
        # (seconds from admission to the upstream's first byte, requests in flight): adaptive limits.
        self.on_first_byte = on_first_byte
        self.relay = Relay(
            upstream=upstream,
            metrics=metrics,
            clock=clock,
            # Retry-After of upstream_unavailable: the outage's length so far (retry_after.py says why).
            outage=OutageClock(clock, estimates.retry_after_min, estimates.retry_after_max),
            on_first_body_byte=self._first_body_byte,
        )
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
    def controller(self) -> AdmissionController:
        return self.admission.controller

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
                refused = await self.relay(forward, send, None, exchange, arrival, None, wire)
                if refused is not None:
                    await self._upstream_refused(send, refused, None, exchange)

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
        intake would refuse (:meth:`Intake.head`, the same checks as the usual path's), one whose
        hooks read the body before it queues (a tenant's quota), or one whose Retry-After
        depends on whether its body asks for a stream (a budget to begin, or
        ``stream_served_at="first_token"`` with a budget). A malformed body of a refused
        request is not seen: its 400 comes when the retry is admitted, as behind any front
        proxy that limits before it parses.
        """
        method: str = scope["method"]
        path: str = scope["path"]
        controller = self.controller
        # A fleet's hint needs a round trip to Redis: the usual (asynchronous) path answers it.
        if not controller.saturated() or method != "POST" or self.fleet_hints is not None:
            return None
        headers: RawHeaders = scope["headers"]
        head = self.intake.head(method, path, headers)
        if isinstance(head, Refusal) or head.request is None:
            return None
        request = head.request
        if not self.hooks.admits_without_body(request) or (
            request.budget is not None
            and (request.budget_to_start or controller.estimator.config.stream_served_at != "end")
        ):
            return None
        arrival = self.clock()
        rejection = controller.refuse_at_once(request)
        if rejection is None:
            return None
        response = rejection_response(rejection, self.reject_status).with_headers(
            self.hooks.rejection_headers(request)
        )
        status, answer = self._head_answer(response, head.route.shape)
        self.metrics.rejected(request.cls, rejection.code, rejection.retry_after)
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
                    rejection.code,
                    status,
                    None,  # body_done
                    0.0,  # queue_time
                    None,  # upstream_start
                    None,  # first_byte
                    None,  # upstream_end
                    rejection.retry_after,
                    rejection.message,  # detail
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

    async def _upstream_refused(
        self, send: Send, refused: UpstreamRefused, cls: str | None, exchange: Exchange
    ) -> None:
        """Answer a request the upstream could not serve with the controller's refusal: the engine
        at capacity (an admitted request's 503), else the upstream unavailable."""
        controller = self.controller
        if refused.overloaded and cls is not None:
            rejection = controller.overloaded_upstream(cls, refused.detail)
            exchange.reject(rejection, Outcome.OVERLOADED)
        else:
            rejection = controller.upstream_unavailable(
                cls or controller.default_class, refused.detail, refused.retry_after
            )
            exchange.reject(rejection, Outcome.UPSTREAM_ERROR)
        await answer(send, rejection_response(rejection, self.reject_status), exchange)

    def _first_body_byte(self, grant: Grant) -> None:
        # The first *body* byte: vLLM sends a stream's headers before its first token, even
        # while the request waits in the engine, so the header time says nothing about load.
        if grant.ticket.admitted_at is None:
            return
        controller = self.controller
        seconds = self.clock() - grant.ticket.admitted_at
        if grant.ticket.request.stream:
            controller.estimator.observe_first_byte(seconds)
        if self.on_first_byte is not None:
            self.on_first_byte(seconds, controller.in_flight())

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
        cls = request.cls
        grant: Grant | None = None
        exchange = Exchange(shape=shape)
        scope = self.hooks.scope(request, forward.body, forward.path, forward.parsed)

        async def work() -> None:
            nonlocal grant, forward, request
            quota = await scope.take_quota()
            if quota is not None:
                request = replace(request, quota=quota)
            if scope.body is not forward.body:
                forward = forward._replace(body=scope.body)
            queued_at = self.clock()
            decision = await self.admission.acquire(request)
            if isinstance(decision, Rejection):
                if self.fleet_hints is not None:
                    rid = request_id_of(forward.headers)
                    soonest = await self.fleet_hints.soonest(rid, decision.retry_after)
                    decision = replace(decision, retry_after=soonest)
                exchange.reject(decision)
                exchange.queue_time = self.clock() - queued_at
                response = rejection_response(decision, self.reject_status)
                await answer(send, response.with_headers(scope.response_headers()), exchange)
                return
            grant = decision
            exchange.queue_time = grant.queue_time
            self.metrics.count(cls, "admitted")
            self.metrics.observe_queue_wait(cls, grant.queue_time)
            refused = await self.relay(forward, send, grant, exchange, arrival, scope, wire)
            if refused is not None:
                await self._upstream_refused(send, refused, cls, exchange)

        try:
            await watch_disconnect(task, receive, work, gone)
        finally:
            if grant is not None:
                self.admission.release(grant, exchange.outcome, exchange.answer_tokens)
            await scope.finish(served=grant is not None, status=exchange.status)
            if exchange.metric == "rejected":
                self.metrics.rejected(cls, exchange.code, exchange.retry_after or 0.0)
            else:
                self.metrics.count(cls, exchange.metric)
            self._log(record, exchange, cls, request.tenant)


def _target(scope: Scope, path: str, route: Route) -> bytes:
    raw: bytes = scope.get("raw_path") or path.encode()
    if route.upstream_path is not None:
        raw = route.upstream_path.encode()
    query: bytes = scope.get("query_string", b"")
    return raw + b"?" + query if query else raw


def _peer(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None
