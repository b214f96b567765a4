"""The streaming relay: one ASGI endpoint for every path of the engine's API the shim serves.

For each request: look the path up in the route table (routes.py: a path no row names is a
404, an operator route not allowed is a 403, and a ``/v1/`` path must stay under ``/v1/``
after normalisation, so only the configured upstream's API is ever reachable), read the
body, take a slot through admission for engine-work routes, forward method, path,
query, headers (Authorization included; hop-by-hop stripped) and body, then relay
status, headers and body chunk by chunk as the upstream sends them.

Raw ASGI rather than a Starlette ``StreamingResponse`` because the relay must watch
the client's connection the whole time: a disconnect while queued gives the queue
place back at once, a disconnect mid-response aborts the upstream request (its
socket is closed, so the engine sees the abort) and frees the slot. The slot is
given back in ``finally`` on every path.

Choices where the protocol is silent:

- only POSTs to the table's ``engine`` routes are admission-controlled, counted in the
  ``requests_total`` metric and carry ``x-queue-time-ms``; ``x-request-class`` and
  ``x-request-timeout-ms`` are validated (400 when malformed) only there; the shim's own
  errors take the route's error shape (Anthropic's on ``/v1/messages``, rejection.py);
- an upstream 503 on a generation request (vLLM's ``--max-num-queued-reqs``
  answer) becomes a ``queue_full`` rejection with the configured status and an
  estimated Retry-After, the upstream's message kept in ours; on other paths it is
  a 503 ``upstream_unavailable``. Other upstream statuses pass through untouched;
- any failure before the upstream's status line (refused, reset, timed out) is a
  503 ``upstream_unavailable`` with Retry-After; a failure mid-response aborts the
  client connection so a cut stream is never passed off as complete.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from llm_backoff_shim.access_log import AccessLog, AccessRecord, request_id
from llm_backoff_shim.admission import (
    AdmissionController,
    AdmissionRequest,
    Outcome,
    Rejection,
    UnknownClassError,
    parse_retry_count,
    requested_max_tokens,
)
from llm_backoff_shim.auth import ApiKeys
from llm_backoff_shim.coarse_timers import CoarseTimers
from llm_backoff_shim.headers import Forwarding, RawHeaders, strip_hop_by_hop
from llm_backoff_shim.http.interface import (
    BODY_FOLLOWS,
    CLIENT_WIRE,
    CONNECTION_GONE,
    ChunkWriter,
    ClientWire,
    ConnectionGone,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeoutError,
    wire_answer,
)
from llm_backoff_shim.intake import (
    ClientGone,
    Refusal,
    check_api_key,
    check_content_type,
    check_declared_length,
    parse_json_object,
    read_body,
    reason_of,
)
from llm_backoff_shim.metrics import ShimMetrics
from llm_backoff_shim.outage import OutageClock
from llm_backoff_shim.rejection import (
    ErrorResponse,
    client_error,
    in_shape,
    operator_route_refused,
    rejection_response,
    server_error,
)
from llm_backoff_shim.request_hooks import RequestHooks, RequestScope, with_headers
from llm_backoff_shim.routes import ROUTES, Kind, Route, RouteTable, Shape, stays_under_v1
from llm_backoff_shim.upstream import UpstreamClient
from llm_backoff_shim.waiting import AsyncAdmission, Grant

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Clock = Callable[[], float]

log = logging.getLogger("llm_backoff_shim.proxy")

#: POST to these paths goes through admission (the ``engine`` rows of routes.py).
GENERATION_PATHS: frozenset[str] = frozenset(r.path for r in ROUTES if r.kind is Kind.ENGINE)
_DEFAULT_ROUTES = RouteTable()

#: Larger request bodies get a 413 instead of being buffered (``--max-body-bytes``).
MAX_BODY_BYTES = 8 * 1024 * 1024

#: RFC 9110 section 7.6.3: a proxy adds itself to ``Via`` in each message it forwards.
VIA = (b"via", b"1.1 llm-backoff-shim")

#: Distinct answers to requests refused from their heads kept for reuse (_head_answer).
_HEAD_ANSWERS_MAX = 512

#: How much of an upstream 503 body is read to explain the rejection.
_OVERLOAD_BODY_LIMIT = 64 * 1024


class UpstreamStreamBroken(Exception):  # noqa: N818 - reads better in logs than ...Error
    """The upstream failed after the response started; the client connection is aborted."""


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


@dataclass(slots=True)
class _Exchange:
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

    def reject(self, rejection: Rejection, outcome: Outcome = Outcome.ABORTED) -> None:
        """Record that the shim turned the request away with ``rejection``."""
        self.outcome, self.metric = outcome, "rejected"
        self.code, self.retry_after, self.detail = rejection.code, rejection.retry_after, rejection.message


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
        # (seconds from admission to the upstream's first byte, requests in flight): adaptive limits.
        self.on_first_byte = on_first_byte
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
        # Retry-After of upstream_unavailable: the outage's length so far (outage.py says why).
        self.outage = OutageClock(clock, estimates.retry_after_min, estimates.retry_after_max)
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
            self._log(record, _Exchange())
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
        forward = _ForwardRequest(
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
            exchange = _Exchange(shape=shape)
            try:
                relay = lambda: self._relay(forward, send, None, exchange, arrival, None, wire)  # noqa: E731
                await _watch_disconnect(task, receive, relay, gone)
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
        'refusals from the head'). A refusal that cannot depend on the body (every slot taken, no place in
        the class's queue: :meth:`AdmissionController.refuse_at_once`) is decided and written
        from the head, as a front proxy's connection or rate limit refuses; the serving
        protocol then reads the body past (relay_protocol.py).

        Anything else takes the usual path, so its answer does not change: a request the
        intake would refuse (path, key, headers, content type, declared size), one whose
        hooks read the body before it queues (a tenant's quota), or one whose Retry-After
        depends on whether its body asks for a stream (``stream_served_at="first_token"``
        with a budget). A malformed body of a refused request is not seen: its 400 comes
        when the retry is admitted, as behind any front proxy that limits before it parses.
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
            or (request.budget is not None and controller.estimator.config.stream_served_at != "end")
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
                    request_id(_raw_header(headers, b"x-request-id")),
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
        exchange = _Exchange(metric="bad_request", code=refusal.reason, shape=shape)
        await _answer(send, refusal.response, exchange)
        self._log(record, exchange)

    def _record(self, scope: Scope, method: str, path: str, arrival: float) -> AccessRecord | None:
        if self.access_log is None or not self.access_log.enabled:
            return None
        client = scope.get("client")
        return AccessRecord(
            method=method,
            path=path,
            arrival=arrival,
            request_id=request_id(_raw_header(scope["headers"], b"x-request-id")),
            client=str(client[0]) if client else None,
        )

    def _log(
        self,
        record: AccessRecord | None,
        exchange: _Exchange,
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
        try:
            budget = parse_budget(_header(headers, b"x-request-timeout-ms"))
        except ValueError as exc:
            return client_error(
                f"invalid x-request-timeout-ms header: {exc}",
                param="x-request-timeout-ms",
                code="invalid_header",
            )
        retry = parse_retry_count(_header(headers, b"x-stainless-retry-count"))
        return AdmissionRequest(cls=cls, budget=budget, tenant=tenant, retry=retry)

    async def _gated(
        self,
        request: AdmissionRequest,
        forward: _ForwardRequest,
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
        exchange = _Exchange(shape=shape)
        scope = self.hooks.scope(request, forward.body, forward.path, forward.parsed)

        async def work() -> None:
            nonlocal grant, forward
            refusal = await scope.admit()
            if refusal is not None:
                exchange.outcome, exchange.metric = Outcome.ABORTED, "rejected"
                exchange.code, exchange.retry_after = refusal.code, refusal.retry_after
                await _answer(send, refusal.response, exchange)
                return
            if scope.body is not forward.body:
                forward = forward._replace(body=scope.body)
            queued_at = self.clock()
            decision = await self.admission.acquire(request)
            if isinstance(decision, Rejection):
                exchange.reject(decision)
                exchange.queue_time = self.clock() - queued_at
                response = rejection_response(decision, self.reject_status)
                await _answer(send, with_headers(response, scope.response_headers()), exchange)
                return
            grant = decision
            exchange.queue_time = grant.queue_time
            self.metrics.count(cls, "admitted")
            self.metrics.observe_queue_wait(cls, grant.queue_time)
            await self._relay(forward, send, grant, exchange, arrival, scope, wire)

        try:
            await _watch_disconnect(task, receive, work, gone)
        finally:
            if grant is not None:
                self.admission.release(grant, exchange.outcome)
            await scope.finish(served=grant is not None, status=exchange.status)
            if exchange.metric == "rejected":
                self.metrics.rejected(cls, exchange.code, exchange.retry_after or 0.0)
            else:
                self.metrics.count(cls, exchange.metric)
            self._log(record, exchange, cls, request.tenant)

    async def _relay(
        self,
        forward: _ForwardRequest,
        send: Send,
        grant: Grant | None,
        exchange: _Exchange | None,
        arrival: float,
        scope: RequestScope | None = None,
        wire: ClientWire | None = None,
    ) -> None:
        exchange = exchange if exchange is not None else _Exchange()
        cls = grant.ticket.cls if grant is not None else None
        exchange.upstream_start = self.clock()
        try:
            response = await self.upstream.pool.request(
                forward.method, forward.target, forward.headers, forward.body
            )
        except UpstreamError as exc:
            # Nothing of a response arrived: the request may be retried elsewhere or later.
            exchange.upstream_end = self.clock()
            if isinstance(exc, UpstreamProtocolError):
                await self._bad_gateway(send, str(exc), exchange)
            else:
                await self._unavailable(send, cls, str(exc), exchange)
            return
        self.outage.answered()
        started = False
        exchange.first_byte = self.clock()
        try:
            if cls is not None:
                self.metrics.observe_first_byte(cls, exchange.first_byte - arrival)
            exchange.status = response.status
            if response.status == 503:
                await self._upstream_overloaded(send, cls, response, exchange)
                return
            headers = strip_hop_by_hop(response.headers, lower=True)
            headers.append(VIA)
            if grant is not None:
                headers.append((b"x-queue-time-ms", str(round(grant.queue_time * 1000)).encode()))
            if scope is not None:
                headers += scope.response_headers()
            # A body already here goes out in the same write as the head (relay_cycle.py).
            start = {"type": "http.response.start", "status": response.status, "headers": headers}
            if response.body_ready():
                start[BODY_FOLLOWS] = True
            await send(start)
            started = True
            exchange.sent = response.status
            ended = False
            try:
                first = True
                while True:
                    chunk = await response.read_chunk()
                    if not chunk:
                        break
                    if first:
                        first = False
                        self._first_body_byte(grant)
                    if scope is not None:
                        scope.observe(chunk)
                    # The upstream's last bytes often arrive with its end: finish in the same
                    # write instead of one more send (and syscall) per response.
                    ended = response.at_eof()
                    await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                    if ended:
                        break
                    if wire is not None:
                        # More to come: a chunked answer (a stream) goes straight to the client.
                        write = wire.chunk_writer()
                        if write is None:
                            wire = None  # an answer with a length: the plain path to its end
                        else:
                            await _splice(response, write, send, scope)
                            ended = True
                            break
            except UpstreamError as exc:
                exchange.outcome, exchange.metric = Outcome.UPSTREAM_ERROR, "upstream_error"
                if response.event_stream:
                    # An error event first, as vLLM ends a stream that fails (the openai SDK raises
                    # APIError on it); the connection is then cut without the stream's last chunk.
                    await send({"type": "http.response.body", "body": _stream_error(exc), "more_body": True})
                raise UpstreamStreamBroken(f"upstream failed mid-response: {exc}") from exc
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            _classify(exchange, response.status)
        finally:
            # Back to the pool when the exchange ended cleanly; otherwise the connection is
            # closed, and the engine sees it drop and aborts the request.
            response.release()
            exchange.upstream_end = self.clock()
            if not started and exchange.metric == "client_disconnected":
                log.debug("client left before the upstream answered")

    def _first_body_byte(self, grant: Grant | None) -> None:
        # The first *body* byte: vLLM sends a stream's headers before its first token, even
        # while the request waits in the engine, so the header time says nothing about load.
        if grant is None or grant.ticket.admitted_at is None:
            return
        seconds = self.clock() - grant.ticket.admitted_at
        if grant.ticket.request.stream:
            self.controller.estimator.observe_first_byte(seconds)
        if self.on_first_byte is not None:
            self.on_first_byte(seconds, self.controller.in_flight())

    async def _unavailable(self, send: Send, cls: str | None, detail: str, exchange: _Exchange) -> None:
        rejection = self.controller.upstream_unavailable(cls or self.controller.default_class, detail)
        rejection = replace(rejection, retry_after=self.outage.failed())
        exchange.reject(rejection, Outcome.UPSTREAM_ERROR)
        await _answer(send, rejection_response(rejection, self.reject_status), exchange)

    async def _bad_gateway(self, send: Send, detail: str, exchange: _Exchange) -> None:
        # The upstream answered, but not in acceptable HTTP: nothing of it is relayed (nginx: 502).
        log.warning("upstream answered with an invalid response: %s", detail)
        self.outage.answered()
        exchange.outcome, exchange.metric, exchange.detail = Outcome.UPSTREAM_ERROR, "upstream_error", detail
        response = server_error(f"invalid response from the upstream: {detail}", code="bad_upstream_response")
        await _answer(send, response, exchange)

    async def _upstream_overloaded(
        self, send: Send, cls: str | None, response: UpstreamResponse, exchange: _Exchange
    ) -> None:
        try:
            detail = _error_message(await response.read(_OVERLOAD_BODY_LIMIT))
        except UpstreamError as exc:
            detail = str(exc)
        if cls is None:
            await self._unavailable(send, None, f"upstream answered 503: {detail}", exchange)
            return
        rejection = self.controller.overloaded_upstream(cls, f"upstream answered 503: {detail}")
        exchange.reject(rejection, Outcome.OVERLOADED)
        await _answer(send, rejection_response(rejection, self.reject_status), exchange)


class _ForwardRequest(NamedTuple):
    # A named tuple: built once per request, and a frozen dataclass's __init__ costs several times more.
    method: str
    path: str
    #: The percent-encoded path and query, as the client sent them (already validated).
    target: bytes
    headers: RawHeaders
    body: bytes
    #: The body as parsed at intake (generation requests), for hooks that read it.
    parsed: dict[str, Any] | None = None


def _target(scope: Scope, path: str, route: Route) -> bytes:
    raw: bytes = scope.get("raw_path") or path.encode()
    if route.upstream_path is not None:
        raw = route.upstream_path.encode()
    query: bytes = scope.get("query_string", b"")
    return raw + b"?" + query if query else raw


def _classify(exchange: _Exchange, status: int) -> None:
    if 200 <= status < 300:
        exchange.outcome, exchange.metric = Outcome.COMPLETED, "completed"
    elif status >= 500:
        exchange.outcome, exchange.metric = Outcome.UPSTREAM_ERROR, "upstream_error"
    else:
        # Relayed as sent, but a quick 4xx says nothing about how long generation takes.
        exchange.outcome, exchange.metric = Outcome.CLIENT_ERROR, "completed"


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
        message = data["error"]["message"] if isinstance(data.get("error"), dict) else data.get("message")
        if isinstance(message, str) and message:
            return message[:300]
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    text = body.decode("utf-8", "replace").strip()
    return text[:300] or "no detail"


def _stream_error(exc: UpstreamError) -> bytes:
    code = "upstream_timeout" if isinstance(exc, UpstreamTimeoutError) else "upstream_error"
    error = {
        "message": f"upstream failed mid-stream: {exc}",
        "type": "server_error",
        "param": None,
        "code": code,
    }
    return b"data: %b\n\n" % json.dumps({"error": error}, separators=(",", ":")).encode()


def _peer(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None


def _raw_header(headers: RawHeaders, name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _header(headers: RawHeaders, name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


async def _watch_disconnect(
    task: asyncio.Task[Any],
    receive: Receive,
    work: Callable[[], Awaitable[None]],
    gone: ConnectionGone | None = None,
) -> bool:
    """Run ``work`` in ``task`` (the current one); cancel it if the client disconnects first.

    Returns True when the client disconnected.

    With the serving protocol's :class:`ConnectionGone` signal (``gone``) the request's
    task is cancelled from the protocol's ``connection_lost``; without it, a watcher task
    waits on ``receive()``.

    After the request body is read, ``receive()`` only ever returns ``http.disconnect``
    (uvicorn also returns it once the response is complete, hence the ``done`` flag).

    Plain asyncio rather than an anyio task group: this runs for every request, and on
    the benchmark machines a task group (task handle, cancel scopes, backend lookup)
    cost about as much CPU as the whole relay (bench/bench_proxy.py). The watcher
    cancels the request's own task; that cancellation is absorbed here, and one that
    came from elsewhere (server shutdown) still propagates.
    """
    done = False
    disconnected = False

    def on_disconnect() -> None:
        nonlocal disconnected
        if not done:
            disconnected = True
            task.cancel()

    stop: Callable[[], object]
    if gone is not None:
        gone.subscribe(on_disconnect)
        stop = functools.partial(gone.unsubscribe, on_disconnect)
    else:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            on_disconnect()

        stop = task.get_loop().create_task(watch()).cancel
    try:
        await work()
    except asyncio.CancelledError:
        if not disconnected or _still_cancelling(task):
            raise
    finally:
        done = True
        stop()
    return disconnected


def _still_cancelling(task: asyncio.Task[Any]) -> bool:
    """After absorbing our own cancel: whether another cancellation is pending (Python >= 3.11)."""
    if sys.version_info >= (3, 11):
        return task.uncancel() > 0
    return False  # 3.10 cannot tell; a shutdown cancel arriving in the same instant is absorbed


async def _splice(
    response: UpstreamResponse, write: ChunkWriter, send: Send, scope: RequestScope | None
) -> None:
    """Relay the rest of a chunked body with :meth:`UpstreamResponse.pipe` onto the client's wire.

    When the client falls behind, the engine's socket stops being read, and uvicorn's
    ``send`` (an empty chunk writes nothing) waits for the client to drain, as it does for
    every ``send`` of the plain path.
    """
    sink = write
    if scope is not None and type(scope).observe is not RequestScope.observe:
        observe = scope.observe

        def sink(chunk: bytes) -> bool:
            observe(chunk)
            return write(chunk)

    while not await response.pipe(sink):
        await send({"type": "http.response.body", "body": b"", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _answer(send: Send, response: ErrorResponse, exchange: _Exchange | None = None) -> None:
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
