"""The proxy's front: one ASGI endpoint for every path of the engine's API the shim serves.

(Over 400 lines: one request's way through the front, route, intake and admission, with the
refusal from the head beside it because it must reach the same answers; the relay, the
exchange and the disconnect watch have their own modules.)

For each request: look the path up in the route table (routes.py: a path no row names is a
404, an operator route not allowed is a 403, and a ``/v1/`` path must stay under ``/v1/``
after normalisation, so only the configured upstream's API is ever reachable), read the
body, take a slot through admission for engine-work routes, and hand the request to the
relay (relay.py), which forwards method, path, query, headers (Authorization included;
hop-by-hop stripped) and body and streams the answer back.

Raw ASGI rather than a Starlette ``StreamingResponse`` because the proxy must watch
the client's connection the whole time (disconnect.py): a disconnect while queued gives
the queue place back at once, a disconnect mid-response aborts the upstream request (its
socket is closed, so the engine sees the abort) and frees the slot. The slot is given
back in ``finally`` on every path.

Choices where the protocol is silent: only POSTs to the table's ``engine`` routes are
admission-controlled, counted in the ``requests_total`` metric and carry
``x-queue-time-ms``; ``x-request-class``, ``x-request-timeout-ms`` and
``x-request-timeout-scope`` are validated (400 when malformed) only there; the shim's own
errors take the route's error shape (Anthropic's on ``/v1/messages``, rejection.py). What
the relay makes of upstream failures and 503s: relay.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.outage import OutageClock
from llm_backoff_shim.decide.requests import (
    AdmissionRequest,
    UnknownClassError,
    parse_retry_count,
    requested_max_tokens,
)
from llm_backoff_shim.decide.tickets import Outcome, Rejection
from llm_backoff_shim.http.coarse_timers import CoarseTimers
from llm_backoff_shim.http.interface import (
    CLIENT_WIRE,
    CONNECTION_GONE,
    ClientWire,
    ConnectionGone,
    wire_answer,
)
from llm_backoff_shim.serve.access_log import AccessLog, AccessRecord, request_id
from llm_backoff_shim.serve.auth import ApiKeys
from llm_backoff_shim.serve.disconnect import watch_disconnect
from llm_backoff_shim.serve.exchange import (
    VIA,
    Clock,
    Exchange,
    ForwardRequest,
    Receive,
    Scope,
    Send,
    answer,
)
from llm_backoff_shim.serve.headers import Forwarding, RawHeaders
from llm_backoff_shim.serve.intake import (
    ClientGone,
    Refusal,
    check_api_key,
    check_content_type,
    check_declared_length,
    header,
    parse_json_object,
    read_body,
    reason_of,
)
from llm_backoff_shim.serve.metrics import ShimMetrics
from llm_backoff_shim.serve.rejection import (
    ErrorResponse,
    client_error,
    in_shape,
    operator_route_refused,
    rejection_response,
)
from llm_backoff_shim.serve.relay import Relay
from llm_backoff_shim.serve.request_hooks import RequestHooks, with_headers
from llm_backoff_shim.serve.routes import ROUTES, Kind, Route, RouteTable, Shape, stays_under_v1
from llm_backoff_shim.serve.upstream import UpstreamClient
from llm_backoff_shim.serve.waiting import AsyncAdmission, Grant

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


def asks_for_stream(body: dict[str, Any]) -> bool:
    """Whether a request body asks for a stream: only a JSON ``true`` does."""
    return body.get("stream") is True


def parse_budget(value: str | None) -> float | None:
    """``x-request-timeout-ms`` -> seconds; None when absent. Raises ValueError when malformed."""
    if value is None or not value.strip():
        return None
    millis = float(value.strip())
    if not math.isfinite(millis) or millis < 0:
        raise ValueError("must be a non-negative number of milliseconds")
    return millis / 1000.0


#: ``x-request-timeout-scope`` values: the budget ends when the answer begins, or at its end.
BUDGET_SCOPES = {"start": True, "end": False}


def parse_budget_scope(value: str | None) -> bool:
    """``x-request-timeout-scope`` -> whether the budget is for the answer to begin (``start``);
    absent or blank is ``end``, the whole call. Raises ValueError for any other value."""
    if value is None or not value.strip():
        return False
    scope = BUDGET_SCOPES.get(value.strip().lower())
    if scope is None:
        raise ValueError("expected 'start' or 'end'")
    return scope


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
    ) -> None:
        self.access_log = access_log
        self.routes = routes if routes is not None else _DEFAULT_ROUTES
        # Who the client is, said to the upstream by the shim (headers.py says why).
        self.forwarding = forwarding if forwarding is not None else Forwarding()
        # Classes by tenant, quotas, SLO headers, vLLM priority; none by default.
        self.hooks = hooks if hooks is not None else RequestHooks()
        self.api_keys = api_keys if api_keys is not None else ApiKeys(())
        self.max_body_bytes = max_body_bytes
        # One shared timer for every request's body timeout (coarse_timers says why).
        self.body_timers = CoarseTimers(body_timeout) if body_timeout else None
        self.upstream = upstream
        self.admission = admission
        self.metrics = metrics
        self.reject_status = reject_status
        self.clock = clock
        estimates = admission.controller.estimator.config
        self.relay = Relay(
            upstream=upstream,
            controller=admission.controller,
            metrics=metrics,
            reject_status=reject_status,
            clock=clock,
            # Retry-After of upstream_unavailable: the outage's length so far (outage.py says why).
            outage=OutageClock(clock, estimates.retry_after_min, estimates.retry_after_max),
            on_first_byte=on_first_byte,
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        arrival = self.clock()
        path: str = scope["path"]
        method: str = scope["method"]
        record = self._record(scope, method, path, arrival)
        route = self.routes.lookup(path)
        if route is None:
            missing = client_error(
                f"no such path {path[:200]!r}: the shim serves the engine's API (docs/shim.md, routes)",
                status=404,
            )
            await self._refuse(send, Refusal("bad_path", missing), record)
            return
        shape = route.shape
        if route.refused:
            await self._refuse(send, Refusal("operator_route", operator_route_refused(path)), record)
            return
        headers: RawHeaders = list(scope["headers"])
        refusal = check_api_key(self.api_keys, headers)
        if refusal is not None:
            await self._refuse(send, refusal, record, shape)
            return
        gated = method == "POST" and route.admitted
        request: AdmissionRequest | None = None
        if gated:
            parsed = self._admission_request(headers)
            if isinstance(parsed, ErrorResponse):
                await self._refuse(send, Refusal(reason_of(parsed), parsed), record, shape)
                return
            request = parsed
            refusal = check_content_type(headers) if route.json_body else None
            if refusal is not None:
                await self._refuse(send, refusal, record, shape)
                return
        refusal = check_declared_length(headers, self.max_body_bytes)
        if refusal is not None:
            await self._refuse(send, refusal, record, shape)
            return
        task = self._current_task()
        try:
            body = await read_body(receive, limit=self.max_body_bytes, time_limit=self.body_timers, task=task)
        except ClientGone:
            if request is not None:
                # Counted, so that every generation request the shim saw has an outcome.
                self.metrics.count(request.cls, "client_disconnected")
            self._log(record, Exchange())
            return  # the client left before sending its whole request
        if record is not None:
            record.body_done = self.clock()
        if isinstance(body, Refusal):
            await self._refuse(send, body, record, shape)
            return
        data: dict[str, Any] | None = None
        if gated and route.json_body:
            checked = parse_json_object(body)
            if isinstance(checked, Refusal):
                await self._refuse(send, checked, record, shape)
                return
            data = checked
            if request is not None:
                stream, most = asks_for_stream(data), requested_max_tokens(data)
                if stream or most is not None:
                    request = replace(request, stream=stream, max_tokens=most)
        forward = ForwardRequest(
            method=method,
            path=path,
            target=_target(scope, path, route),
            headers=[*self.forwarding.request_headers(headers, _peer(scope)), VIA],
            body=body,
            parsed=data,
        )
        extensions = scope.get("extensions")
        gone = extensions.get(CONNECTION_GONE) if extensions else None
        wire = extensions.get(CLIENT_WIRE) if extensions else None
        if request is None:
            exchange = Exchange(shape=shape)
            try:
                relay = lambda: self.relay(forward, send, None, exchange, arrival, None, wire)  # noqa: E731
                await watch_disconnect(task, receive, relay, gone)
            finally:
                self._log(record, exchange)
        else:
            await self._gated(request, forward, receive, send, arrival, task, record, gone, wire, shape)

    def refuse_from_head(self, scope: Scope) -> bytes | None:
        """The whole answer to a generation request refused as soon as its head is parsed, or
        None: then nothing was done, and the request takes the usual path.

        Why: under a burst every refusal costs the shim its whole request path (a task, the
        body read and parsed, the ASGI messages), about 0.2 ms of CPU each, and a burst of a
        few hundred requests then waits tens of ms for its answers (docs/benchmarks.md,
        'Refusals from the request's head'). A refusal that cannot depend on the body (every slot
        taken, no place in the class's queue: :meth:`AdmissionController.refuse_at_once`) is
        decided and written from the head, as a front proxy's connection or rate limit refuses; the serving
        protocol then reads the body past (relay_protocol.py).

        Anything else takes the usual path, so its answer does not change: a request the
        intake would refuse (path, key, headers, content type, declared size), one whose
        hooks read the body before it queues (a tenant's quota), or one whose Retry-After
        depends on whether its body asks for a stream (a budget to begin, or
        ``stream_served_at="first_token"`` with a budget). A malformed body of a refused
        request is not seen: its 400 comes when the retry is admitted, as behind any front
        proxy that limits before it parses.
        """
        method: str = scope["method"]
        path: str = scope["path"]
        controller = self.controller
        if not controller.saturated() or method != "POST":
            return None
        route = self.routes.lookup(path)
        if route is None or not route.admitted or route.refused:
            return None
        headers: RawHeaders = scope["headers"]
        if (
            check_api_key(self.api_keys, headers) is not None
            or (route.json_body and check_content_type(headers) is not None)
            or check_declared_length(headers, self.max_body_bytes) is not None
        ):
            return None
        request = self._admission_request(headers)
        if (
            isinstance(request, ErrorResponse)
            or not self.hooks.admits_without_body(request)
            or (
                request.budget is not None
                and (request.budget_to_start or controller.estimator.config.stream_served_at != "end")
            )
        ):
            return None
        arrival = self.clock()
        rejection = controller.refuse_at_once(request)
        if rejection is None:
            return None
        response = self.hooks.decorate(rejection_response(rejection, self.reject_status), request)
        status, answer = self._head_answer(response, route.shape)
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
                    request_id(header(headers, b"x-request-id")),
                    _peer(scope),  # client
                )
            )
        return answer

    def _head_answer(self, response: ErrorResponse, shape: Shape) -> tuple[int, bytes]:
        """The status and bytes of ``response`` in the route's error shape, remembered by value:
        refusals from the head repeat (the same few hints, codes and headers)."""
        key = (shape, response.status, response.body, *response.headers)
        known = self._head_answers.get(key)
        if known is None:
            if shape is not Shape.OPENAI:
                response = in_shape(response, shape)
            known = response.status, wire_answer(response.status, response.headers, response.body)
            if len(self._head_answers) >= _HEAD_ANSWERS_MAX:
                self._head_answers.clear()
            self._head_answers[key] = known
        return known

    async def _refuse(
        self, send: Send, refusal: Refusal, record: AccessRecord | None, shape: Shape = Shape.OPENAI
    ) -> None:
        self.metrics.bad_request(refusal.reason)
        exchange = Exchange(metric="bad_request", code=refusal.reason, shape=shape)
        await answer(send, refusal.response, exchange)
        self._log(record, exchange)

    def _record(self, scope: Scope, method: str, path: str, arrival: float) -> AccessRecord | None:
        if self.access_log is None or not self.access_log.enabled:
            return None
        return AccessRecord(
            method=method,
            path=path,
            arrival=arrival,
            request_id=request_id(header(scope["headers"], b"x-request-id")),
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

    def _admission_request(self, headers: RawHeaders) -> AdmissionRequest | ErrorResponse:
        class_header = _header(headers, b"x-request-class")
        try:
            chosen = self.hooks.choose_class(headers, class_header, self.controller)
        except UnknownClassError as exc:
            return client_error(str(exc), param="x-request-class", code="invalid_request_class")
        if isinstance(chosen, ErrorResponse):
            return chosen
        cls, tenant = chosen
        name = "x-request-timeout-ms"
        try:
            budget = parse_budget(_header(headers, b"x-request-timeout-ms"))
            name = "x-request-timeout-scope"
            to_start = parse_budget_scope(_header(headers, b"x-request-timeout-scope"))
        except ValueError as exc:
            return client_error(f"invalid {name} header: {exc}", param=name, code="invalid_header")
        retry = parse_retry_count(_header(headers, b"x-stainless-retry-count"))
        return AdmissionRequest(
            cls=cls,
            budget=budget,
            tenant=tenant,
            retry=retry,
            budget_to_start=to_start and budget is not None,
        )

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
            nonlocal grant, forward
            refusal = await scope.admit()
            if refusal is not None:
                exchange.outcome, exchange.metric = Outcome.ABORTED, "rejected"
                exchange.code, exchange.retry_after = refusal.code, refusal.retry_after
                await answer(send, refusal.response, exchange)
                return
            if scope.body is not forward.body:
                forward = forward._replace(body=scope.body)
            queued_at = self.clock()
            decision = await self.admission.acquire(request)
            if isinstance(decision, Rejection):
                exchange.reject(decision)
                exchange.queue_time = self.clock() - queued_at
                response = rejection_response(decision, self.reject_status)
                await answer(send, with_headers(response, scope.response_headers()), exchange)
                return
            grant = decision
            exchange.queue_time = grant.queue_time
            self.metrics.count(cls, "admitted")
            self.metrics.observe_queue_wait(cls, grant.queue_time)
            await self.relay(forward, send, grant, exchange, arrival, scope, wire)

        try:
            await watch_disconnect(task, receive, work, gone)
        finally:
            if grant is not None:
                self.admission.release(grant, exchange.outcome)
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


def _header(headers: RawHeaders, name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
